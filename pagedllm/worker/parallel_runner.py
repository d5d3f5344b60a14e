"""One rank of a tensor/pipeline-parallel model: its shard of the weights, its KV cache, its part of
every step.

The driver (rank 0) is the engine's runner: it builds a step's inputs as usual, sends them to every
rank (:class:`~pagedllm.distributed.step_channel.StepChannel`), runs its own part, computes the
logits of the rows it samples and samples. Every other rank runs :meth:`ParallelModelRunner.serve`:
it takes the driver's commands in order and runs the same part of each step on its shard.

The first pipeline stage holds the vocabulary: the embedding and the LM head (one table when they are
tied). A stage sends each micro-batch's ``(x, residual)`` on to the next as soon as its layers are
done; the last stage applies the final norm and sends the rows whose logits are wanted back to the
first stage (each rank to the rank of its tensor-parallel index there), whose ranks compute the
logits on their vocabulary rows and gather them on the driver. Only hidden states cross between
stages, never vocabulary-wide rows.

With ``pipelined`` steps (the engine's scheduling ahead over ``pp`` stages) the driver launches a
step, runs its stage and returns; the step's rows come back, and are sampled, when its tokens are
asked for, while the driver's stage already runs the next step (another group of requests): every
stage works on a different step. A decode step is one micro-batch; a prompt step is cut into
micro-batches of whole requests (:func:`pagedllm.sched.scheduler.plan_micro_batches`) so that the
next stage starts on its first part. Without pipelining, a step is cut into ``2 * pp``
micro-batches and the driver waits for its rows.

Every receive is posted before the sender needs it to be taken (the next command header, a step's
activations, the rows coming back), so a busy rank never holds up another's send.

Decode-only steps of a pipeline stage without tensor parallelism run its layers in one native call
on the CPU; tensor-parallel ranks run the Python forward (the all-reduces sit inside the layers), and
CUDA graphs are off.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from pagedllm.attention.base import AttentionMetadata
from pagedllm.distributed.groups import ParallelGroups
from pagedllm.distributed.layers import parallelize
from pagedllm.distributed.placement import local_model_config, pad_vocab_rows
from pagedllm.distributed.step_channel import FORWARD, LOGITS, SHUTDOWN, StepChannel, StepTensors
from pagedllm.kernels.cpu.quant import QuantizedWeight
from pagedllm.model.config import ModelConfig
from pagedllm.model.llama import ForwardContext, LlamaForCausalLM
from pagedllm.sample.sampler import DeviceSamples
from pagedllm.sched.scheduler import SchedulerOutput, plan_micro_batches
from pagedllm.worker.model_runner import BatchInputs, ModelRunner
from pagedllm.worker.phase_times import StepPhaseTimes
from pagedllm.worker.runner_output import DeferredSamples, RunnerOutput

logger = logging.getLogger(__name__)

_VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")

# Micro-batches per pipeline stage in a step that is not pipelined with others: the stages overlap
# on all but one micro-batch's worth of it (fill and drain); each micro-batch also re-reads the
# stage's weights in a decode step.
MICRO_BATCHES_PER_STAGE = 2
# Pipelined prompt steps: tokens per micro-batch, at least (fewer, larger parts keep the matrix
# products efficient; more let the next stage start sooner).
PREFILL_MICRO_BATCH_TOKENS = 512


def _pad_rows(weight: torch.Tensor | QuantizedWeight, rows: int) -> torch.Tensor | QuantizedWeight:
    if isinstance(weight, QuantizedWeight):
        if weight.out_features >= rows:
            return weight
        blocks = pad_vocab_rows(weight.blocks, rows)  # zero bytes decode to zero in every GGUF type
        return QuantizedWeight(weight.type_name, (rows, weight.in_features), blocks.contiguous())
    return pad_vocab_rows(weight, rows)


class _ReturnedRows:
    """Final hidden states of one step's rows on a first-stage rank: computed here (one stage), or
    sent back by the last stage, into a receive posted when the step started."""

    def __init__(self, hidden: torch.Tensor, source: int | None = None) -> None:
        self.hidden = hidden
        self.work: dist.Work | None = None
        if source is not None:
            work = dist.irecv(hidden, src=source)
            assert work is not None
            self.work = work

    def take(self) -> torch.Tensor:
        """The rows (waits for them once)."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.hidden


class ParallelModelRunner(ModelRunner):
    """A :class:`ModelRunner` over one rank's shard (see the module docstring).

    ``model_config`` is the whole model's; ``weights`` the rank's selection of the checkpoint
    (:func:`pagedllm.distributed.placement.weight_selection`), layers under their global indices.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        weights: dict[str, Any],
        groups: ParallelGroups,
        **kwargs: Any,
    ) -> None:
        placement = groups.placement
        self.groups = groups
        self.placement = placement
        self.global_config = model_config
        self.stage_layers = placement.layer_range(model_config.num_hidden_layers)
        self.vocab = placement.vocab_range(model_config.vocab_size)
        local = local_model_config(model_config, placement)
        first = self.stage_layers.start
        renamed: dict[str, Any] = {}
        for name, tensor in weights.items():
            if name.startswith("model.layers."):
                index, rest = name.removeprefix("model.layers.").split(".", 1)
                name = f"model.layers.{int(index) - first}.{rest}"
            elif name in _VOCAB_TENSORS:
                tensor = _pad_rows(tensor, local.vocab_size)
            renamed[name] = tensor
        super().__init__(local, renamed, **kwargs)
        # KV tensors for this stage's layers only.
        self.config = dataclasses.replace(local, num_hidden_layers=len(self.stage_layers))
        parallelize(self.model, groups, self.vocab.start)
        self.channel = StepChannel(groups.commands, placement.world_size)
        # Sends under way to other ranks, each with its tensor (referenced until the send is done).
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        # Whether the driver launches steps without waiting for their rows (see the module docstring).
        self.pipelined = False
        # Forwards run so far: every rank counts the same FORWARD commands, so a number names a step.
        self._forwards = 0
        # First stage: each step's rows whose logits will be asked for, by forward number (oldest first).
        self._returned: dict[int, _ReturnedRows] = {}

    def _place_model(self, model: LlamaForCausalLM) -> LlamaForCausalLM:
        p = self.placement
        layers = [model.layers[i] for i in self.stage_layers]
        for local_index, layer in enumerate(layers):
            layer.self_attn.layer_idx = local_index  # type: ignore[union-attr]
        model.layers = nn.ModuleList(layers)
        if not p.is_first_stage:
            model.embed_tokens = nn.Identity()
            model.lm_head = nn.Identity()
        return model

    def enable_native_decode(self) -> None:
        if self.placement.tp_size == 1:
            super().enable_native_decode()  # a pipeline stage's layers in one native call
        else:
            logger.info(
                "Decode-only steps use the Python forward: tensor-parallel ranks all-reduce inside layers."
            )

    def capture_cuda_graphs(self, max_num_seqs: int) -> None:
        logger.info("CUDA graphs are off on tensor/pipeline-parallel ranks; running eagerly.")

    # -- the step, on every rank ------------------------------------------------------------
    def _stage_forward(
        self, step: StepTensors, micro_batches: int, meta: AttentionMetadata | None = None
    ) -> torch.Tensor | None:
        """This stage's layers over the step, in up to ``micro_batches`` micro-batches; the final
        hidden states on the last stage, None elsewhere. ``meta``: the whole step's metadata when the
        caller has it (the driver), used as is when the step is one micro-batch."""
        assert self.kv_cache is not None, "KV cache not allocated"
        p = self.placement
        device = self.device
        qsl = step.query_start_loc.tolist()
        query_lens = [b - a for a, b in zip(qsl[:-1], qsl[1:], strict=True)]
        batches = plan_micro_batches(query_lens, micro_batches)
        outputs: list[torch.Tensor] = []
        # Every micro-batch's (x, residual) from the previous stage, received into buffers posted now,
        # so that the previous stage's sends go through as soon as it makes them.
        incoming: list[tuple[dist.Work, torch.Tensor]] = []
        if not p.is_first_stage:
            for start, stop in batches:
                shape = (2, qsl[stop] - qsl[start], self.global_config.hidden_size)
                buffer = torch.empty(shape, dtype=self.dtype, device=device)
                work = dist.irecv(buffer, src=p.rank - p.tp_size)
                assert work is not None
                incoming.append((work, buffer))
        for index, (start, stop) in enumerate(batches):
            t0, t1 = qsl[start], qsl[stop]
            part = StepTensors(
                step.input_ids[t0:t1],
                step.positions[t0:t1],
                step.slot_mapping[t0:t1],
                step.query_start_loc[start : stop + 1] - t0,
                step.seq_lens[start:stop],
                step.block_tables[start:stop],
            )
            part_meta = meta if meta is not None and len(batches) == 1 else part.metadata(device)
            ctx = ForwardContext(part_meta, self.kv_cache.layers, self.backend)
            carried = None
            if incoming:
                work, buffer = incoming[index]
                work.wait()
                carried = (buffer[0], buffer[1])
            ids, positions = part.input_ids.to(device), part.positions.to(device)
            native = self.native_decode
            if native is not None and ctx.meta.is_decode_only:
                x, residual = native.forward_layers(ids, positions, ctx.meta, carried, final=p.is_last_stage)
                if p.is_last_stage:
                    outputs.append(x)  # after the final norm
                    continue
            else:
                x, residual = self.model.forward_layers(ids, positions, ctx, carried)
            if p.is_last_stage:
                outputs.append(self.model.norm.forward_residual(x, residual)[0])
            else:
                self._send_on(torch.stack([x, residual]), p.rank + p.tp_size)
        if not p.is_last_stage:
            return None
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _send_on(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` without waiting for ``dst`` to take it (kept referenced until it has)."""
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        work = dist.isend(tensor, dst=dst)
        assert work is not None
        self._sends.append((work, tensor))

    def _run_forward(
        self,
        step: StepTensors,
        micro_batches: int,
        rows: torch.Tensor | None,
        meta: AttentionMetadata | None = None,
    ) -> int:
        """Run this rank's part of a step, and return the final hidden states of ``rows`` (None: every
        row) to the first stage; returns the step's forward number."""
        number = self._forwards
        self._forwards += 1
        if meta is not None and meta.single_prompt_seqs:
            # The other ranks rebuild the metadata from the step's tensors, without the prompt
            # tokens alone in their chunks: every rank attends them as decodes.
            meta = dataclasses.replace(meta, single_prompt_seqs=())
        p = self.placement
        last_stage_rank = p.stage_ranks(p.pp_size - 1)[p.tp_rank]
        hidden = self._stage_forward(step, micro_batches, meta)
        if rows is not None and rows.numel() == 0:
            return number
        if p.is_last_stage:
            assert hidden is not None
            hidden = hidden if rows is None else hidden.index_select(0, rows.to(hidden.device))
            if not p.is_first_stage:
                self._send_on(hidden.contiguous(), p.tp_rank)  # the first stage's rank of this index
                return number
            returned = _ReturnedRows(hidden)
        elif p.is_first_stage:
            count = step.input_ids.numel() if rows is None else rows.numel()
            buffer = torch.empty(count, self.global_config.hidden_size, dtype=self.dtype, device=self.device)
            returned = _ReturnedRows(buffer, last_stage_rank)
        else:
            return number
        self._returned[number] = returned
        # Kept until asked for again no more: a step's logits are all asked for before ``pp`` more
        # steps have started (at most ``pp - 1`` are in flight, and a step run alone asks at once).
        while len(self._returned) > p.pp_size + 2:
            self._returned.pop(next(iter(self._returned))).take()
        return number

    def _logits(
        self, number: int, rows: torch.Tensor | None, hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        """On a first-stage rank: logits of ``rows`` (None: all) of forward ``number``'s returned
        rows (or of ``hidden``, those rows at hand), on this rank's vocabulary rows; gathered,
        ``[rows, vocab]``, on the driver, which first asks the stage's other ranks for theirs."""
        if self.placement.is_driver and self.placement.tp_size > 1:
            everything = torch.empty(0, dtype=torch.int64)
            self.channel.send_logits(number, everything if rows is None else rows, self.placement.tp_size)
        if hidden is None:
            hidden = self._returned[number].take()
            if rows is not None:
                hidden = hidden.index_select(0, rows.to(hidden.device))
        gathered = self.groups.gather_columns(self.model.compute_logits(hidden))
        if gathered is None:
            return torch.empty(0)
        return gathered[:, : self.global_config.vocab_size].contiguous()

    # -- the driver -------------------------------------------------------------------------
    def _step_tensors(self, inputs: BatchInputs) -> StepTensors:
        meta = inputs.meta
        return StepTensors(
            inputs.input_ids.cpu(),
            inputs.positions.cpu(),
            meta.slot_mapping.cpu(),
            meta.query_start_loc.cpu(),
            meta.seq_lens.cpu(),
            meta.block_tables.cpu(),
        )

    def _eager_forward(self, inputs: BatchInputs) -> torch.Tensor:
        """Every row's final hidden states, on the driver (waits for the last stage)."""
        step = self._step_tensors(inputs)
        micro_batches = self.placement.pp_size * MICRO_BATCHES_PER_STAGE
        self.channel.send_forward(step, micro_batches, None)
        self._last_forward = self._run_forward(step, micro_batches, None, inputs.meta)
        return self._returned.pop(self._last_forward).take()

    def logits_of(
        self, hidden: torch.Tensor, rows: torch.Tensor | slice, prompt: np.ndarray | None = None
    ) -> torch.Tensor:
        """Logits of rows of the hidden states :meth:`_eager_forward` returned. (A rank's quantized
        products run every row on the integer kernels: the step's prompt rows, ``prompt``, are not
        sent to the other ranks, so the LM head does not take the AMX tiles either.)"""
        if isinstance(rows, slice):
            rows = torch.arange(rows.start, rows.stop, dtype=torch.int64)
        return self._logits(self._last_forward, rows.cpu(), hidden.index_select(0, rows.to(hidden.device)))

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput, times: StepPhaseTimes | None = None) -> RunnerOutput:
        """A pipelined step (see the module docstring) runs the driver's stage and returns; its
        sampled rows are sampled when asked for. A step asking for prompt logprobs runs alone, as
        :meth:`ModelRunner.launch` does."""
        if not self.pipelined or any(
            s.request.params.prompt_logprobs is not None for s in scheduler_output.scheduled_requests
        ):
            return super().launch(scheduler_output, times)
        assert self.kv_cache is not None, "KV cache not allocated"
        times = times if times is not None else StepPhaseTimes()
        started = time.perf_counter()
        inputs = self.prepare_inputs(scheduler_output)
        prepared = time.perf_counter()
        times.prepare += prepared - started
        step = self._step_tensors(inputs)
        rows = inputs.logits_indices.cpu() if inputs.sample_rows else torch.empty(0, dtype=torch.int64)
        # A decode step is one micro-batch; a prompt step is cut so that the next stage starts on its
        # first part.
        cap = self.placement.pp_size * MICRO_BATCHES_PER_STAGE
        micro_batches = max(1, min(cap, step.input_ids.numel() // PREFILL_MICRO_BATCH_TOKENS))
        self.channel.send_forward(step, micro_batches, rows)
        number = self._run_forward(step, micro_batches, rows, inputs.meta)
        times.forward += time.perf_counter() - prepared
        self.previous_tokens = None  # a pipelined step never holds a request with a pending token
        if not inputs.sample_rows:
            return RunnerOutput([], None)
        sample_rows = inputs.sample_rows

        def sample() -> DeviceSamples:
            hidden = self._returned.pop(number).take()
            return self.sample(scheduler_output, sample_rows, self._logits(number, None, hidden))

        return RunnerOutput(sample_rows, DeferredSamples(sample))

    def shutdown_ranks(self) -> None:
        """Tell every other rank to leave :meth:`serve`."""
        self.channel.send_shutdown()

    # -- every other rank -------------------------------------------------------------------
    @torch.inference_mode()
    def serve(self) -> None:
        """Run the driver's commands until it sends SHUTDOWN (a failed collective raises)."""
        while True:
            command = self.channel.receive()
            if command.kind == FORWARD:
                assert command.step is not None
                self._run_forward(command.step, command.micro_batches, command.rows)
            elif command.kind == LOGITS:
                assert command.rows is not None
                self._logits(command.number, command.rows if command.rows.numel() else None)
            elif command.kind == SHUTDOWN:
                return
