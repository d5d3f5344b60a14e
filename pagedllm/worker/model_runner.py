"""Runs the model over one scheduled batch: input preparation, forward, logits, sampling."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.base import AttentionBackend, AttentionMetadata
from pagedllm.attention.selector import get_attention_backend
from pagedllm.kernels.cpu.library import cpu_flags
from pagedllm.kernels.cpu.linear import optimize_cpu_linears
from pagedllm.kernels.cpu.quant import QuantizedWeight
from pagedllm.kernels.cpu.row_paths import prompt_rows
from pagedllm.lora.mapping import LoRAMapping, lora_rows
from pagedllm.lora.registry import LoRAConfig
from pagedllm.model.config import ModelConfig
from pagedllm.model.cpu_decode import NativeDecodeLayers, unsupported_reason
from pagedllm.model.empty_init import empty_modules, to_empty
from pagedllm.model.layers import RotaryEmbedding
from pagedllm.model.llama import ForwardContext, LlamaForCausalLM
from pagedllm.model.moe import pack_cpu_experts
from pagedllm.model.pooling import pool_hidden
from pagedllm.model.quantization import install_gguf_blocks, quantize_float_linears
from pagedllm.model.registry import model_class
from pagedllm.outputs import Logprob
from pagedllm.sample.logits_processors import needs_logits_processing
from pagedllm.sample.sampler import DeviceSamples, SampledTokens, Sampler, SamplingInputs
from pagedllm.sched.scheduler import SchedulerOutput
from pagedllm.spec.rejection import draft_tensor, rejection_sample, verify_greedy
from pagedllm.worker.cpu_memory import keep_freed_memory
from pagedllm.worker.cuda_graphs import CUDAGraphRunner
from pagedllm.worker.devices import to_device
from pagedllm.worker.kv_cache import KVCache
from pagedllm.worker.lora_steps import LoRAWorker
from pagedllm.worker.phase_times import StepPhaseTimes
from pagedllm.worker.runner_output import PromptLogprobsChunk, RunnerOutput, VerifiedSamples
from pagedllm.worker.step_inputs import StepInputBuilder

logger = logging.getLogger(__name__)

# Prompt positions whose logprobs are computed together (each holds a vocabulary of float32 logits).
PROMPT_LOGPROBS_POSITIONS = 256


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the flat batch whose logits are sampled
    sample_rows: list[int]  # indices into scheduler_output.scheduled_requests of the sampled requests
    row_starts: list[int]  # first flat-batch row of each scheduled request
    # Per flat-batch row: a prompt token (its position below its request's prompt length), whose
    # quantized products take the AMX tiles where they run; None where the rows are not known.
    prompt_rows: np.ndarray | None = None
    # The rows that run a LoRA adapter, by slot (None: every row runs the base model).
    lora: LoRAMapping | None = None


@dataclass
class PreviousTokens:
    """Where the tokens sampled by the last launched step are, for a step scheduled ahead of them:
    request id -> row of ``token_ids`` (on the device)."""

    rows: dict[str, int]
    token_ids: torch.Tensor


class ModelRunner:
    """Owns the model weights, the KV cache tensors and the sampler on one device."""

    def __init__(
        self,
        model_config: ModelConfig,
        weights: dict[str, torch.Tensor | QuantizedWeight],
        *,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        attention_backend: str,
        max_num_seqs: int = 256,
        quantization: str = "none",
    ) -> None:
        """``weights`` may hold GGUF blocks (kept quantized, CPU only); ``quantization`` ``int8`` or
        ``fp8`` quantizes the float projections after loading (see :mod:`pagedllm.model.quantization`)."""
        self.config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.backend: AttentionBackend = get_attention_backend(attention_backend)
        with empty_modules():
            model = self._place_model(model_class(model_config)(model_config, max_model_len))
        model = to_empty(model, "cpu")
        # Buffers are not in the checkpoint: rebuild the rotary tables for real.
        model.init_rotary(max_model_len)
        model.load_weights(install_gguf_blocks(model, weights))
        self.model = model.to(device=device, dtype=dtype).eval()
        # Rotary tables stay fp32 for accuracy.
        for module in self.model.modules():
            if isinstance(module, RotaryEmbedding):
                module.to(dtype=torch.float32)
        if quantization in ("int8", "fp8"):
            count = quantize_float_linears(self.model, quantization, device)
            logger.info("Weight-only %s: %d linear layers quantized.", quantization, count)
        if device.type == "cpu" and dtype == torch.bfloat16:
            hardware = (
                "AVX-512 BF16" if "avx512_bf16" in cpu_flags() else "emulated: this CPU has no AVX-512 BF16"
            )
            logger.warning(
                "bfloat16 on the CPU runs through torch's kernels (%s); the native kernels are float32, and "
                "dtype='float32' is several times faster.",
                hardware,
            )
        if device.type == "cpu":
            logger.info("CPU linear layers: %s weights", optimize_cpu_linears(self.model))
            if packed := pack_cpu_experts(self.model):
                logger.info("CPU experts: %d sparse layers in panel form", packed)
            keep_freed_memory()
        self.sampler = Sampler()
        self.kv_cache: KVCache | None = None
        self._cuda_graphs: CUDAGraphRunner | None = None
        self.native_decode: NativeDecodeLayers | None = None
        self.previous_tokens: PreviousTokens | None = None
        self.lora: LoRAWorker | None = None
        # Rows for every request that can run at once (tables up to max_model_len), shared by the
        # eager path and the CUDA graphs.
        self.input_builder = StepInputBuilder(block_size, max_num_seqs, -(-max_model_len // block_size))

    @property
    def cuda_graphs(self) -> CUDAGraphRunner | None:
        """The decode graphs, when captured. They stage their inputs with this runner's
        :attr:`input_builder` (set on assignment): the eager path and the graphs read one set of
        block tables, which every step's changes update once."""
        return self._cuda_graphs

    @cuda_graphs.setter
    def cuda_graphs(self, graphs: CUDAGraphRunner | None) -> None:
        if graphs is not None:
            graphs.input_builder = self.input_builder
        self._cuda_graphs = graphs

    def _place_model(self, model: LlamaForCausalLM) -> LlamaForCausalLM:
        """The model this runner holds, given the whole model built on the meta device (a pipeline
        stage keeps its layers only: :class:`pagedllm.worker.parallel_runner.ParallelModelRunner`)."""
        return model

    @property
    def kv_bytes_per_block(self) -> int:
        cfg = self.config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * cfg.num_hidden_layers * self.block_size * cfg.num_key_value_heads * cfg.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg = self.config
        self.kv_cache = KVCache(
            num_layers=cfg.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=self.block_size,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            dtype=self.dtype,
            device=self.device,
        )

    @torch.inference_mode()
    def profile_peak_memory(self, num_tokens: int, num_sampled: int) -> int:
        """Peak bytes held by torch's CUDA allocator (weights included) over a dummy prefill.

        The forward covers ``num_tokens`` prompt tokens (split into sequences of at most
        ``max_model_len``) against a one-block temporary cache, writing no K/V, followed by the logits
        and a softmax of ``num_sampled`` rows, as the sampler computes them.
        """
        if self.device.type != "cuda":
            raise ValueError("memory profiling needs a CUDA device.")
        dev = self.device
        cfg = self.config
        seq_len = min(num_tokens, self.max_model_len)
        lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        starts = np.zeros(len(lens) + 1, dtype=np.int32)
        np.cumsum(lens, out=starts[1:])
        cache = KVCache(
            num_layers=cfg.num_hidden_layers,
            num_blocks=1,
            block_size=self.block_size,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            dtype=self.dtype,
            device=dev,
        )
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),
            query_start_loc=torch.from_numpy(starts).to(dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            # Every position reads block 0 of the temporary cache.
            block_tables=torch.zeros(
                len(lens), -(-seq_len // self.block_size), dtype=torch.int32, device=dev
            ),
            max_query_len=max(lens),
            max_seq_len=max(lens),
            query_lens_cpu=lens,
            seq_lens_cpu=lens,
        )
        positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens]).to(dev)
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        hidden = self.model(input_ids, positions, ForwardContext(meta, cache.layers, self.backend))
        logits = self.model.compute_logits(hidden[-min(num_sampled, num_tokens) :])
        torch.softmax(logits, dim=-1)
        torch.cuda.synchronize(dev)
        peak = int(torch.cuda.max_memory_allocated(dev))
        del hidden, logits, cache, meta
        torch.cuda.empty_cache()
        return peak

    def capture_cuda_graphs(self, max_num_seqs: int) -> None:
        """Capture the decode CUDA graphs (see :mod:`pagedllm.worker.cuda_graphs`) over the allocated
        KV cache; only on CUDA with the Triton attention backend, which launches without host syncs."""
        assert self.kv_cache is not None, "KV cache not allocated"
        if self.device.type != "cuda":
            return
        if not self.backend.supports_graph_capture:
            logger.info(
                "The %s attention backend does not support CUDA graphs; running eagerly.", self.backend.name
            )
            return
        graphs = CUDAGraphRunner(
            self.model,
            self.kv_cache.layers,
            max_num_seqs=max_num_seqs,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            device=self.device,
            backend=self.backend,
            input_builder=self.input_builder,
        )
        graphs.capture()
        self.cuda_graphs = graphs

    def enable_lora(self, config: LoRAConfig) -> LoRAWorker:
        """Wrap the model's projections in LoRA layers with ``config.max_loras`` slots (before any
        CUDA graph or native decode is set up: those run the base model only)."""
        assert self.cuda_graphs is None and self.native_decode is None
        self.lora = LoRAWorker(self.model, self.config, config, self.device, self.dtype)
        return self.lora

    def enable_native_decode(self) -> None:
        """Run decode-only steps through :class:`NativeDecodeLayers` from now on, where the model,
        device and attention backend allow it (logged either way)."""
        assert self.kv_cache is not None, "allocate the KV cache first"
        reason = unsupported_reason(self.model, self.backend.name)
        if reason is None:
            self.native_decode = NativeDecodeLayers(self.model, self.kv_cache.layers)
            logger.info("Decode-only steps run the decoder layers in one native call.")
        else:
            logger.info("Decode-only steps use the Python forward: %s.", reason)

    # -- input preparation ------------------------------------------------------------------
    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> BatchInputs:
        """The step's inputs on the device, for the eager forward (built by :attr:`input_builder`)."""
        host = self.input_builder.build(scheduler_output)
        dev = self.device
        seq_lens = host.seq_lens_list
        meta = AttentionMetadata(
            slot_mapping=to_device(torch.from_numpy(host.slot_mapping), dev),
            query_start_loc=to_device(torch.from_numpy(host.query_start_loc), dev),
            seq_lens=to_device(torch.from_numpy(host.seq_lens), dev),
            block_tables=to_device(torch.from_numpy(host.block_tables), dev),
            max_query_len=max(host.query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=host.query_lens,
            seq_lens_cpu=seq_lens,
            single_prompt_seqs=tuple(
                i
                for i, (ql, start) in enumerate(
                    zip(host.query_lens, host.query_start_loc.tolist(), strict=False)
                )
                if ql == 1 and host.prompt_rows[start]
            ),
        )
        input_ids = to_device(torch.from_numpy(host.token_ids), dev)
        self._fill_pending_tokens(scheduler_output, input_ids, host.query_start_loc[1:] - 1)
        lora = self.lora.mapping(scheduler_output, host.query_start_loc) if self.lora is not None else None
        return BatchInputs(
            lora=lora,
            input_ids=input_ids,
            positions=to_device(torch.from_numpy(host.positions), dev),
            meta=meta,
            logits_indices=to_device(torch.tensor(host.logits_indices, dtype=torch.int64), dev),
            sample_rows=host.sample_rows,
            row_starts=host.query_start_loc[:-1].tolist(),
            prompt_rows=host.prompt_rows,
        )

    def _fill_pending_tokens(
        self, scheduler_output: SchedulerOutput, input_ids: torch.Tensor, last_rows: np.ndarray
    ) -> None:
        """Write the ids of pending tokens, sampled by the previous step and still on the device, into
        ``input_ids`` (``last_rows[i]``: the flat-batch row of scheduled request ``i``'s last token)."""
        pending = [
            i
            for i, scheduled in enumerate(scheduler_output.scheduled_requests)
            if scheduled.request.num_pending_tokens
            and scheduled.request.num_computed_tokens + scheduled.num_tokens > scheduled.request.num_tokens
        ]
        if not pending:
            return
        previous = self.previous_tokens
        assert previous is not None, "pending tokens without a previous step"
        src = [previous.rows[scheduler_output.scheduled_requests[i].request.request_id] for i in pending]
        n = len(pending)
        if pending[-1] == n - 1 and last_rows[n - 1] == n - 1 and src == list(range(n)):
            # Steady decode: request i of this step was row i of the last one and is flat row i now.
            input_ids[:n].copy_(previous.token_ids[:n])
            return
        dst = to_device(torch.from_numpy(last_rows[pending].astype(np.int64)), self.device)
        index = to_device(torch.tensor(src, dtype=torch.int64), self.device)
        input_ids.index_copy_(0, dst, previous.token_ids.index_select(0, index))

    # -- execution --------------------------------------------------------------------------
    def _forward(
        self, scheduler_output: SchedulerOutput, times: StepPhaseTimes
    ) -> tuple[BatchInputs, torch.Tensor, torch.Tensor | None]:
        """The model over one step: ``(inputs, hidden states of every row, logits of the sampled rows)``.

        Decode-only steps replay a CUDA graph when one was captured, which also yields the logits;
        other steps run eagerly and leave the logits to the caller (None).
        """
        assert self.kv_cache is not None, "KV cache not allocated"
        graphs = self.cuda_graphs
        started = time.perf_counter()
        if graphs is None or not graphs.can_run(scheduler_output):
            inputs = self.prepare_inputs(scheduler_output)
            prepared = time.perf_counter()
            times.prepare += prepared - started
            hidden = self._eager_forward(inputs)
            times.forward += time.perf_counter() - prepared
            return inputs, hidden, None
        n = len(scheduler_output.scheduled_requests)
        bucket = graphs.load_inputs(scheduler_output)
        self._fill_pending_tokens(scheduler_output, graphs.input_ids, np.arange(n))
        prepared = time.perf_counter()
        times.prepare += prepared - started
        hidden, logits = graphs.replay(bucket)
        times.forward += time.perf_counter() - prepared
        sample_rows = scheduler_output.sample_rows
        if len(sample_rows) == n:
            logits_indices = graphs.query_start_loc[:n]  # 0 .. n-1: one row per request
            logits = logits[:n]
        else:
            logits_indices = to_device(torch.tensor(sample_rows, dtype=torch.int64), self.device)
            logits = logits[logits_indices]
        inputs = BatchInputs(
            input_ids=graphs.input_ids[:n],
            positions=graphs.positions[:n],
            meta=graphs.metadata(bucket),
            logits_indices=logits_indices,
            sample_rows=sample_rows,
            row_starts=list(range(n)),
        )
        return inputs, hidden[:n], logits

    def _eager_forward(self, inputs: BatchInputs) -> torch.Tensor:
        """Hidden states of every row of the step, after the final norm (no CUDA graph)."""
        assert self.kv_cache is not None, "KV cache not allocated"
        mask = inputs.prompt_rows
        if self.native_decode is not None and inputs.meta.is_decode_only and (mask is None or not mask.any()):
            # (the native layers run every row on the integer kernels: decode rows only)
            plan = inputs.lora.native_plan() if inputs.lora is not None else None
            return self.native_decode(inputs.input_ids, inputs.positions, inputs.meta, plan)
        ctx = ForwardContext(inputs.meta, self.kv_cache.layers, self.backend)
        with lora_rows(inputs.lora):
            if mask is None:
                return self.model(inputs.input_ids, inputs.positions, ctx)
            with prompt_rows(mask):
                return self.model(inputs.input_ids, inputs.positions, ctx)

    def logits_of(
        self, hidden: torch.Tensor, rows: torch.Tensor | slice, prompt: np.ndarray | None = None
    ) -> torch.Tensor:
        """float32 logits ``[rows, vocab]`` of ``hidden[rows]``, the step's hidden states; ``prompt``
        (the step's :attr:`BatchInputs.prompt_rows`) sends the LM head's prompt rows to the AMX tiles
        as the forward sent them."""
        if prompt is None:
            return self.model.compute_logits(hidden[rows])
        selected = prompt[rows] if isinstance(rows, slice) else prompt[rows.cpu().numpy()]
        with prompt_rows(selected):
            return self.model.compute_logits(hidden[rows])

    def _prompt_logprobs(
        self, scheduler_output: SchedulerOutput, inputs: BatchInputs, hidden: torch.Tensor
    ) -> dict[str, PromptLogprobsChunk]:
        """Prompt logprobs of the prompt positions this step computed, each position once: those a
        request has already reported (``Request.prompt_logprobs``, kept by the engine; a prompt
        computed again after preemption) are skipped."""
        found: dict[str, PromptLogprobsChunk] = {}
        for row, scheduled in enumerate(scheduler_output.scheduled_requests):
            req = scheduled.request
            k = req.params.prompt_logprobs
            if k is None or req.prompt_logprobs is None:
                continue
            start = req.num_computed_tokens
            # Position p predicts prompt token p + 1; positions already reported are skipped.
            first = max(start, len(req.prompt_logprobs) - 1)
            last = min(start + scheduled.num_tokens, req.num_prompt_tokens - 1)
            if first >= last:
                continue
            base = inputs.row_starts[row] - start
            entries: list[dict[int, Logprob] | None] = []
            # In slices of positions, so a long prompt never holds full-vocabulary float rows for
            # every position at once.
            for lo in range(first, last, PROMPT_LOGPROBS_POSITIONS):
                hi = min(lo + PROMPT_LOGPROBS_POSITIONS, last)
                entries += self._prompt_logprobs_slice(
                    hidden,
                    slice(base + lo, base + hi),
                    req.prompt_token_ids[lo + 1 : hi + 1],
                    k,
                    inputs.prompt_rows,
                )
            found[req.request_id] = (first, entries)
        return found

    def _prompt_logprobs_slice(
        self,
        hidden: torch.Tensor,
        rows: slice,
        targets_list: list[int],
        k: int,
        prompt: np.ndarray | None,
    ) -> list[dict[int, Logprob] | None]:
        """Logprob entries of ``targets_list`` (the prompt tokens that ``hidden[rows]``'s positions
        predict)."""
        logits = self.logits_of(hidden, rows, prompt)
        logprobs = torch.log_softmax(logits, dim=-1)
        del logits
        targets = torch.tensor(targets_list, device=logprobs.device)
        target_lp = logprobs.gather(1, targets[:, None]).squeeze(1)
        ranks = (logprobs > target_lp[:, None]).sum(-1) + 1
        top_lp, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
        entries: list[dict[int, Logprob] | None] = []
        for i in range(len(targets_list)):
            entry = {int(targets[i]): Logprob(float(target_lp[i]), int(ranks[i]))}
            if top_ids is not None and top_lp is not None:
                for r, (tid, lp) in enumerate(zip(top_ids[i].tolist(), top_lp[i].tolist(), strict=True)):
                    entry.setdefault(tid, Logprob(lp, r + 1))
            entries.append(entry)
        return entries

    @torch.inference_mode()
    def pool(
        self, scheduler_output: SchedulerOutput, pooling_type: str, times: StepPhaseTimes
    ) -> torch.Tensor:
        """Run the rest of every scheduled prompt (its KV written to the cache as usual) and pool each
        prompt's final hidden states: ``[n, hidden]`` float32 on the host, nothing sampled.

        Each request computes all its remaining prompt tokens in this step; only ``last`` pooling may
        start after a cached prefix (the engine turns prefix caching off for the other types)."""
        lens = []
        for s in scheduler_output.scheduled_requests:
            req = s.request
            if req.num_computed_tokens + s.num_tokens != req.num_prompt_tokens or (
                pooling_type != "last" and req.num_computed_tokens
            ):
                raise ValueError(f"request {req.request_id}: a pooled prompt runs whole, in one step.")
            lens.append(s.num_tokens)
        _, hidden, _ = self._forward(scheduler_output, times)
        self.previous_tokens = None
        started = time.perf_counter()
        pooled = pool_hidden(hidden, lens, pooling_type).cpu()
        times.forward += time.perf_counter() - started
        return pooled

    def sample(
        self, scheduler_output: SchedulerOutput, sample_rows: list[int], logits: torch.Tensor
    ) -> DeviceSamples:
        """Sample the next token of ``sample_rows`` (rows of the scheduled requests) from their
        ``logits``, with each request's grammar mask and sampling parameters."""
        reqs = [scheduler_output.scheduled_requests[r].request for r in sample_rows]
        # A grammar waiting for its start marker (StructuredOutputsParams.after) leaves its row free.
        grammars = [r.grammar if r.grammar is not None and r.grammar.is_active else None for r in reqs]
        masked_rows = [i for i, g in enumerate(grammars) if g is not None]
        if masked_rows:
            from pagedllm.structured.grammar import apply_grammar_bitmask  # xgrammar loads on first use

            apply_grammar_bitmask(logits, grammars)
        batch = SamplingInputs(
            params=[r.params for r in reqs],
            prompt_token_ids=[r.prompt_token_ids for r in reqs],
            output_token_ids=[r.output_token_ids for r in reqs],
            generators=[r.generator for r in reqs],
            bad_words_token_ids=[r.bad_words_token_ids for r in reqs],
            eos_token_ids=reqs[0].eos_token_ids,
            masked_rows=masked_rows,
        )
        return self.sampler.sample(logits, batch)

    def _verify(
        self, scheduler_output: SchedulerOutput, sample_rows: list[int], logits: torch.Tensor
    ) -> VerifiedSamples:
        """Sample a step in which some requests verify draft tokens. ``logits`` holds, per sampled
        request, one row per verified position (its drafts + 1). Requests without drafts are sampled
        as usual; the others go through :func:`~pagedllm.spec.rejection.rejection_sample` with the
        sampler's distribution at every position (drafts are only proposed for requests whose
        distribution reads no earlier output, see ``Request.can_sample_ahead``)."""
        scheduled = scheduler_output.scheduled_requests
        counts = [len(scheduled[r].draft_token_ids) for r in sample_rows]
        starts = np.concatenate([[0], np.cumsum([c + 1 for c in counts])]).tolist()
        plain = [j for j, c in enumerate(counts) if c == 0]
        drafted = [j for j, c in enumerate(counts) if c > 0]
        n = len(sample_rows)
        token_ids, sampled_logprobs = [0] * n, [0.0] * n
        logprobs: list[dict[int, Logprob] | None] = [None] * n
        accepted: list[list[int]] = [[] for _ in range(n)]
        accepted_logprobs: list[list[float]] = [[] for _ in range(n)]
        if plain:
            last = torch.tensor([starts[j] for j in plain], dtype=torch.int64, device=logits.device)
            out = self.sample(scheduler_output, [sample_rows[j] for j in plain], logits[last]).output()
            for i, j in enumerate(plain):
                token_ids[j], logprobs[j] = out.token_ids[i], out.logprobs[i]
                sampled_logprobs[j] = out.sampled_logprobs[i]
        width = max(counts) + 1
        reqs = [scheduled[sample_rows[j]].request for j in drafted]
        index = [starts[j] + min(p, counts[j]) for j in drafted for p in range(width)]  # padded rows repeat
        block = logits[torch.tensor(index, dtype=torch.int64, device=logits.device)]
        batch = SamplingInputs(
            params=[r.params for r in reqs for _ in range(width)],
            prompt_token_ids=[r.prompt_token_ids for r in reqs for _ in range(width)],
            output_token_ids=[r.output_token_ids for r in reqs for _ in range(width)],
            generators=[None] * len(index),
            bad_words_token_ids=[r.bad_words_token_ids for r in reqs for _ in range(width)],
            eos_token_ids=reqs[0].eos_token_ids,
        )
        drafts, num = draft_tensor([scheduled[sample_rows[j]].draft_token_ids for j in drafted], width - 1)
        drafts = drafts.to(logits.device)
        if all(p.greedy for p in batch.params) and not any(
            needs_logits_processing(batch, i) for i in range(0, len(index), width)
        ):  # the target's argmax, with no processor to apply: accept the longest match
            verified = verify_greedy(drafts, num, block.view(len(reqs), width, -1).argmax(dim=-1))
        else:
            probs = self.sampler.probabilities(block, batch).view(len(reqs), width, -1)
            verified = rejection_sample(drafts, num, probs, None, [r.generator for r in reqs])
        # Raw log probabilities of the emitted tokens (for the sequences' cumulative log probability).
        shaped = block.float().view(len(reqs), width, -1)
        lse = torch.logsumexp(shaped, dim=-1)
        for i, j in enumerate(drafted):
            emitted = verified.token_ids[i]
            at = torch.arange(len(emitted))
            lps = (shaped[i, at, torch.tensor(emitted).clamp(min=0)] - lse[i, at]).tolist()
            token_ids[j], sampled_logprobs[j] = emitted[-1], lps[-1]
            accepted[j], accepted_logprobs[j] = emitted[:-1], lps[:-1]
        return VerifiedSamples(
            SampledTokens(token_ids, logprobs, sampled_logprobs, accepted, accepted_logprobs)
        )

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput, times: StepPhaseTimes | None = None) -> RunnerOutput:
        """Run one step up to sampling without waiting for the device: the rows of
        ``scheduled_requests`` that get a token, their tokens still on the device, and the step's
        prompt logprobs (see :class:`RunnerOutput`).

        Rows whose last token is pending (see :class:`pagedllm.sched.scheduler.Scheduler`) read it
        from the step launched before this one. Phase times are added to ``times`` when given.
        """
        assert self.kv_cache is not None, "KV cache not allocated"
        times = times if times is not None else StepPhaseTimes()
        inputs, hidden, logits = self._forward(scheduler_output, times)
        prompt_logprobs = self._prompt_logprobs(scheduler_output, inputs, hidden)
        if not inputs.sample_rows:
            self.previous_tokens = None
            return RunnerOutput([], None, prompt_logprobs)
        started = time.perf_counter()
        if logits is None:
            logits = self.logits_of(hidden, inputs.logits_indices, inputs.prompt_rows)
        sampling = time.perf_counter()
        times.forward += sampling - started
        scheduled = scheduler_output.scheduled_requests
        if any(scheduled[r].draft_token_ids for r in inputs.sample_rows):
            self.previous_tokens = None  # speculative steps are not scheduled ahead
            verified = self._verify(scheduler_output, inputs.sample_rows, logits)
            times.sample += time.perf_counter() - sampling
            return RunnerOutput(inputs.sample_rows, verified, prompt_logprobs)
        sampled = self.sample(scheduler_output, inputs.sample_rows, logits)
        rows = {scheduled[r].request.request_id: j for j, r in enumerate(inputs.sample_rows)}
        self.previous_tokens = PreviousTokens(rows, sampled.token_ids)
        sampled.copy_to_host()
        times.sample += time.perf_counter() - sampling
        return RunnerOutput(inputs.sample_rows, sampled, prompt_logprobs)
