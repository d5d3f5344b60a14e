"""One rank of a tensor/pipeline-parallel model: its shard of the weights, its KV cache, its part of
every step.

The driver (rank 0) is the engine's runner: it builds a step's inputs as usual, sends them to every
rank (:class:`~pagedllm.distributed.step_channel.StepChannel`), runs its own part, asks for the logits
of the rows it samples, and samples. Every other rank runs :meth:`ParallelModelRunner.serve`: it
waits for the driver's commands and runs the same part of each step on its shard.

A step through ``pp`` pipeline stages is cut into up to ``2 * pp`` micro-batches of whole requests
(:func:`pagedllm.core.scheduler.plan_micro_batches`); a stage sends each micro-batch's ``(x,
residual)`` on to the next stage as soon as its layers are done and starts the next micro-batch, so
the stages work on different micro-batches at once. The last stage keeps the final hidden states;
logits are computed there on each rank's vocabulary rows, gathered on the stage's first rank and, if
that is not the driver, sent to it.

Decode-only steps of a pipeline stage without tensor parallelism run its layers in one native call
on the CPU; tensor-parallel ranks run the Python forward (the all-reduces sit inside the layers), and
CUDA graphs are off.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pagedllm.attention.base import AttentionMetadata
from pagedllm.core.scheduler import plan_micro_batches
from pagedllm.distributed.groups import ParallelGroups
from pagedllm.distributed.layers import parallelize
from pagedllm.distributed.placement import local_model_config, pad_vocab_rows
from pagedllm.distributed.step_channel import FORWARD, LOGITS, SHUTDOWN, StepChannel, StepTensors
from pagedllm.kernels.cpu.quant import QuantizedWeight
from pagedllm.model.config import ModelConfig
from pagedllm.model.llama import ForwardContext, LlamaForCausalLM
from pagedllm.worker.model_runner import BatchInputs, ModelRunner

logger = logging.getLogger(__name__)

_VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")

# Micro-batches per pipeline stage in a step: the stages overlap on all but one micro-batch's worth of
# each step (fill and drain), so more shrink that bubble; each also re-reads the stage's weights in a
# decode step. On the CPU, 2 per stage gave the best PP 2 throughput of 1, 2 and 4 (docs/PERFORMANCE.md).
MICRO_BATCHES_PER_STAGE = 2


def _pad_rows(weight: torch.Tensor | QuantizedWeight, rows: int) -> torch.Tensor | QuantizedWeight:
    if isinstance(weight, QuantizedWeight):
        if weight.out_features >= rows:
            return weight
        blocks = pad_vocab_rows(weight.blocks, rows)  # zero bytes decode to zero in every GGUF type
        return QuantizedWeight(weight.type_name, (rows, weight.in_features), blocks.contiguous())
    return pad_vocab_rows(weight, rows)


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
        self.channel = StepChannel(groups.control)
        self.hidden: torch.Tensor | None = None  # the last forward's final hidden states (last stage)

    def _place_model(self, model: LlamaForCausalLM) -> LlamaForCausalLM:
        p = self.placement
        layers = [model.layers[i] for i in self.stage_layers]
        for local_index, layer in enumerate(layers):
            layer.self_attn.layer_idx = local_index  # type: ignore[union-attr]
        model.layers = nn.ModuleList(layers)
        if not p.is_first_stage and not (p.is_last_stage and model.config.tie_word_embeddings):
            model.embed_tokens = nn.Identity()
        if not p.is_last_stage:
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
    def _stage_forward(self, step: StepTensors, meta: AttentionMetadata | None = None) -> torch.Tensor | None:
        """This stage's layers over the step, micro-batch by micro-batch; the final hidden states on
        the last stage, None elsewhere. ``meta``: the whole step's metadata when the caller has it
        (the driver), used as is when the step is one micro-batch."""
        assert self.kv_cache is not None, "KV cache not allocated"
        p = self.placement
        device = self.device
        qsl = step.query_start_loc.tolist()
        query_lens = [b - a for a, b in zip(qsl[:-1], qsl[1:], strict=True)]
        batches = plan_micro_batches(query_lens, p.pp_size * MICRO_BATCHES_PER_STAGE)
        outputs: list[torch.Tensor] = []
        pending: list[Any] = []
        hidden_size = self.global_config.hidden_size
        for start, stop in batches:
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
            if not p.is_first_stage:
                x = torch.empty(t1 - t0, hidden_size, dtype=self.dtype, device=device)
                residual = torch.empty_like(x)
                source = p.rank - p.tp_size
                dist.recv(x, src=source)
                dist.recv(residual, src=source)
                carried = (x, residual)
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
                target = p.rank + p.tp_size
                pending += [
                    dist.isend(x.contiguous(), dst=target),
                    dist.isend(residual.contiguous(), dst=target),
                ]
        for work in pending:
            work.wait()
        if not p.is_last_stage:
            return None
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _stage_logits(self, rows: torch.Tensor) -> torch.Tensor | None:
        """Logits ``[rows, vocab]`` of the last forward's ``rows`` on the driver; None elsewhere."""
        p = self.placement
        full = None
        last_leader = p.stage_ranks(p.pp_size - 1)[0]
        if p.is_last_stage:
            assert self.hidden is not None, "logits asked before a forward"
            local = self.model.compute_logits(self.hidden.index_select(0, rows.to(self.hidden.device)))
            gathered = self.groups.gather_columns(local)
            if gathered is not None:
                full = gathered[:, : self.global_config.vocab_size].contiguous()
                if not p.is_driver:
                    dist.send(full, dst=0)
        if p.is_driver and p.rank != last_leader:
            full = torch.empty(
                rows.numel(), self.global_config.vocab_size, dtype=torch.float32, device=self.device
            )
            dist.recv(full, src=last_leader)
        return full

    # -- the driver -------------------------------------------------------------------------
    def _eager_forward(self, inputs: BatchInputs) -> torch.Tensor:
        meta = inputs.meta
        step = StepTensors(
            inputs.input_ids.cpu(),
            inputs.positions.cpu(),
            meta.slot_mapping.cpu(),
            meta.query_start_loc.cpu(),
            meta.seq_lens.cpu(),
            meta.block_tables.cpu(),
        )
        self.channel.send_forward(step)
        self.hidden = self._stage_forward(step, meta)
        # The driver of a pipeline holds no final hidden states: rows are asked by index.
        return self.hidden if self.hidden is not None else torch.empty(step.input_ids.numel(), 0)

    def logits_of(self, hidden: torch.Tensor, rows: torch.Tensor | slice) -> torch.Tensor:
        if isinstance(rows, slice):
            rows = torch.arange(rows.start, rows.stop, dtype=torch.int64)
        rows = rows.cpu()
        self.channel.send_logits(rows)
        logits = self._stage_logits(rows)
        assert logits is not None
        return logits

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
                self.hidden = self._stage_forward(command.step)
            elif command.kind == LOGITS:
                assert command.rows is not None
                self._stage_logits(command.rows)
            elif command.kind == SHUTDOWN:
                return
