"""CUDA graphs for decode-only steps.

At start-up the model forward (embedding, decoder layers, final norm, and the logits of every row) is
captured once per batch-size bucket (1, 2, 4, 8, then multiples of 16 up to ``max_num_seqs``, which is
always a bucket). A step whose requests all compute exactly one token replays the graph of the smallest
bucket that holds it, after copying its inputs into the graph's static buffers; prefill and mixed
steps run eagerly.

Rows past the batch are padding: token 0 at position 0, slot -1 (their K/V are written nowhere) and a
context of one position in block 0 (always a valid block), so they compute finite garbage that nobody
reads.

What capture relies on:

* Every tensor the graph reads is a static buffer (inputs, KV caches, weights) updated in place; the
  attention metadata of each bucket is one object built from views of those buffers.
* Attention runs on a backend that supports capture (Triton) with a launch configuration fixed per bucket (chosen for the
  longest possible context), so the launch grid never depends on the context lengths of a step.
* The forward never synchronises with the host (no ``.item()``, ``.tolist()`` or tensor truth values).
* Each bucket runs once eagerly before it is captured, so Triton compiles its kernels (and cuBLAS
  picks its algorithms) outside the capture.

Inputs are staged in pinned host memory and copied with ``non_blocking=True``; an event recorded
after the copies guards the staging buffers against being rewritten before the copies have run.
The staged inputs come from the model runner's :class:`~pagedllm.worker.step_inputs.StepInputBuilder`,
the same builder its eager steps use.

On other devices nothing is captured: :meth:`CUDAGraphRunner.replay` runs the same forward eagerly
over the static buffers, which exercises the bucketing, padding and static metadata without a GPU
(the Triton kernels then run in the interpreter).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence

import torch

from pagedllm.attention.base import AttentionBackend, AttentionMetadata
from pagedllm.attention.selector import get_attention_backend
from pagedllm.model.config import ModelConfig
from pagedllm.model.llama import ForwardContext, LlamaForCausalLM
from pagedllm.sched.scheduler import SchedulerOutput
from pagedllm.worker.step_inputs import DecodeInputs, StepInputBuilder

logger = logging.getLogger(__name__)

# Batch sizes below the first multiple of the step get their own graphs.
_SMALL_BATCH_SIZES = (1, 2, 4, 8)
BATCH_SIZE_STEP = 16


def capture_batch_sizes(max_num_seqs: int) -> list[int]:
    """Ascending batch sizes to capture: 1, 2, 4, 8, 16, 32, ... and ``max_num_seqs`` itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}.")
    sizes = [s for s in _SMALL_BATCH_SIZES if s <= max_num_seqs]
    sizes += list(range(BATCH_SIZE_STEP, max_num_seqs + 1, BATCH_SIZE_STEP))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def select_batch_size(batch_sizes: Sequence[int], num_seqs: int) -> int | None:
    """The smallest of the ascending ``batch_sizes`` that holds ``num_seqs`` rows (None if none does)."""
    if num_seqs < 1:
        raise ValueError(f"a decode batch has at least one sequence, got {num_seqs}.")
    i = bisect.bisect_left(batch_sizes, num_seqs)
    return batch_sizes[i] if i < len(batch_sizes) else None


def graph_memory_estimate(config: ModelConfig, max_num_seqs: int, dtype: torch.dtype) -> int:
    """Rough upper bound on the device memory the decode graphs keep (their private memory pool).

    The shared float32 logits output plus the activations of the largest bucket (the pool is shared,
    graphs being replayed one at a time), the split-K partials of attention and a fixed allowance.
    """
    rows = capture_batch_sizes(max_num_seqs)[-1]
    elem = torch.tensor([], dtype=dtype).element_size()
    logits = rows * config.vocab_size * (4 + elem)
    per_row = 8 * config.hidden_size + 4 * config.intermediate_size + 2 * (config.q_size + 2 * config.kv_size)
    activations = rows * per_row * elem
    splits = rows * config.num_attention_heads * 16 * (config.head_dim + 1) * 4
    hidden_outputs = sum(capture_batch_sizes(max_num_seqs)) * config.hidden_size * elem
    return logits + activations + splits + hidden_outputs + (128 << 20)


class CUDAGraphRunner:
    """Captures and replays the decode forward of ``model`` over ``kv_caches`` (see the module docstring).

    The KV caches must stay allocated, at the same addresses, for the life of this object.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        backend: AttentionBackend | None = None,
        input_builder: StepInputBuilder | None = None,
    ) -> None:
        """``backend`` must support graph capture (default: the Triton backend); ``input_builder`` is
        the model runner's, shared with its eager steps (default: one of its own)."""
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend if backend is not None else get_attention_backend("triton")
        if not self.backend.supports_graph_capture:
            raise ValueError(f"attention backend {self.backend.name!r} does not support CUDA graphs.")
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.batch_sizes = capture_batch_sizes(max_num_seqs)
        rows = self.batch_sizes[-1]
        self.max_blocks_per_seq = -(-max_model_len // block_size)

        # Static device inputs; row i of every buffer belongs to request i of the batch.
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(rows, self.max_blocks_per_seq, dtype=torch.int32, device=device)
        # Every request of a decode batch has one query token, so this never changes.
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        # Static output shared by all graphs (one is replayed at a time).
        self.logits = torch.zeros(rows, model.config.vocab_size, dtype=torch.float32, device=device)

        # Host staging buffers (pinned on CUDA) and numpy views of them.
        on_cuda = device.type == "cuda"

        def pinned(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, pin_memory=on_cuda)

        self._staged = {
            "input_ids": pinned(rows, torch.int64),
            "positions": pinned(rows, torch.int64),
            "slot_mapping": pinned(rows, torch.int64),
            "seq_lens": pinned(rows, torch.int32),
            "block_tables": pinned(rows * self.max_blocks_per_seq, torch.int32),
        }
        self.staging = DecodeInputs(**{name: t.numpy() for name, t in self._staged.items()})
        self.staging.slot_mapping[:] = -1
        self.staging.seq_lens[:] = 1
        self._inputs_copied = torch.cuda.Event() if on_cuda else None
        self.input_builder = input_builder or StepInputBuilder(block_size, rows, self.max_blocks_per_seq)

        self._metas: dict[int, AttentionMetadata] = {}
        self._contexts: dict[int, ForwardContext] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._hidden: dict[int, torch.Tensor] = {}
        self.capture_time_s: float | None = None

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def metadata(self, batch_size: int) -> AttentionMetadata:
        """The attention metadata of a bucket: views of the static buffers.

        ``max_seq_len`` and ``seq_lens_cpu`` hold the upper bound ``max_model_len``: the real context
        lengths are only in the device tensor ``seq_lens``.
        """
        meta = self._metas.get(batch_size)
        if meta is None:
            b = batch_size
            meta = AttentionMetadata(
                slot_mapping=self.slot_mapping[:b],
                query_start_loc=self.query_start_loc[: b + 1],
                seq_lens=self.seq_lens[:b],
                block_tables=self.block_tables[:b],
                max_query_len=1,
                max_seq_len=self.max_model_len,
                query_lens_cpu=[1] * b,
                seq_lens_cpu=[self.max_model_len] * b,
            )
            self._metas[batch_size] = meta
        return meta

    def _backend(self, batch_size: int) -> AttentionBackend:
        """An attention backend whose launches suit any context of this bucket (asked of the backend)."""
        cfg = self.model.config
        k_cache = self.kv_caches[0][0]
        query = torch.empty(
            batch_size, cfg.num_attention_heads, cfg.head_dim, dtype=k_cache.dtype, device=self.device
        )
        return self.backend.for_graph_capture(query, k_cache, self.metadata(batch_size))

    def _forward(self, batch_size: int, ctx: ForwardContext) -> torch.Tensor:
        b = batch_size
        hidden = self.model(self.input_ids[:b], self.positions[:b], ctx)
        self.model.compute_logits(hidden, out=self.logits[:b])
        return hidden

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture one graph per bucket, largest first, all in one memory pool; returns the seconds taken.

        Off CUDA this only prepares each bucket's forward context.
        """
        start = time.perf_counter()
        for b in self.batch_sizes:
            self._contexts[b] = ForwardContext(self.metadata(b), self.kv_caches, self._backend(b))
        if self.device.type != "cuda":
            self.capture_time_s = time.perf_counter() - start
            return self.capture_time_s
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        for b in reversed(self.batch_sizes):
            ctx = self._contexts[b]
            # The static buffers hold padding rows only (slot -1): warm-up and capture write no KV.
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._forward(b, ctx)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._hidden[b] = self._forward(b, ctx)
            self._graphs[b] = graph
        torch.cuda.synchronize(self.device)
        self.capture_time_s = time.perf_counter() - start
        logger.info(
            "Captured CUDA graphs for %d decode batch sizes (1 to %d) in %.1fs.",
            len(self.batch_sizes),
            self.max_batch_size,
            self.capture_time_s,
        )
        return self.capture_time_s

    def can_run(self, scheduler_output: SchedulerOutput) -> bool:
        """Whether a captured graph computes this step: every request has exactly one new token."""
        n = len(scheduler_output.scheduled_requests)
        return (
            bool(self._contexts)
            and 0 < n <= self.max_batch_size
            and all(scheduled.num_tokens == 1 for scheduled in scheduler_output.scheduled_requests)
        )

    def load_inputs(self, scheduler_output: SchedulerOutput) -> int:
        """Stage a decode step's inputs and copy them into the static buffers; returns its bucket."""
        n = len(scheduler_output.scheduled_requests)
        b = select_batch_size(self.batch_sizes, n)
        if b is None:
            raise ValueError(
                f"a decode batch of {n} requests exceeds the largest graph ({self.max_batch_size})."
            )
        # The previous step's copies must have read the staging buffers before they are rewritten.
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()
        inputs = self.input_builder.build(scheduler_output, padded_rows=b, out=self.staging)
        width = inputs.block_tables.shape[1]
        staged = self._staged
        self.input_ids[:b].copy_(staged["input_ids"][:b], non_blocking=True)
        self.positions[:b].copy_(staged["positions"][:b], non_blocking=True)
        self.slot_mapping[:b].copy_(staged["slot_mapping"][:b], non_blocking=True)
        self.seq_lens[:b].copy_(staged["seq_lens"][:b], non_blocking=True)
        tables = staged["block_tables"][: b * width].view(b, width)
        self.block_tables[:b, :width].copy_(tables, non_blocking=True)
        if self._inputs_copied is not None:
            self._inputs_copied.record()
        return b

    @torch.inference_mode()
    def replay(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay a bucket's graph on the loaded inputs: (hidden states, float32 logits), one row per
        row of the bucket. Both are static outputs, overwritten by the next replay."""
        graph = self._graphs.get(batch_size)
        if graph is not None:
            graph.replay()
        else:
            self._hidden[batch_size] = self._forward(batch_size, self._contexts[batch_size])
        return self._hidden[batch_size], self.logits[:batch_size]
