"""Tensor-parallel forms of a loaded model's layers.

A rank's model is built from its shard of every weight (:mod:`pagedllm.distributed.placement`), so
column-parallel projections (fused q/k/v, gate/up) and attention over its own heads need nothing
more. :func:`parallelize` then wraps what needs communication:

- each row-parallel projection (``o_proj``, ``down_proj``): its partial sums are all-reduced over the
  tensor-parallel group (:class:`RowParallel`);
- the embedding: each rank looks up the ids in its vocabulary rows, zero elsewhere, and the rows are
  all-reduced (:class:`VocabParallelEmbedding`).

The LM head stays a plain projection onto the rank's vocabulary rows; the runner gathers the
columns (:meth:`pagedllm.distributed.groups.ParallelGroups.gather_columns`). Wrapping happens after
the CPU and quantized forms are installed, so it wraps whatever form a layer has.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.groups import ParallelGroups
from pagedllm.model.llama import DecoderLayer, LlamaForCausalLM


class RowParallel(nn.Module):
    """``inner(x)`` summed over the tensor-parallel ranks (each holds some input columns)."""

    def __init__(self, inner: nn.Module, groups: ParallelGroups) -> None:
        super().__init__()
        self.inner = inner
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.groups.all_reduce(self.inner(x))


class VocabParallelEmbedding(nn.Module):
    """Embedding rows ``[start, start + rows)`` of the vocabulary on this rank; ids elsewhere look up
    zeros, and the ranks' results are summed."""

    def __init__(self, inner: nn.Module, start: int, rows: int, groups: ParallelGroups) -> None:
        super().__init__()
        self.inner = inner
        self.start = start
        self.rows = rows
        self.groups = groups

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = self.inner(local.masked_fill(outside, 0))
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.groups.all_reduce(out)


def parallelize(model: LlamaForCausalLM, groups: ParallelGroups, vocab_start: int) -> None:
    """Wrap ``model``'s row-parallel projections and embedding (see the module docstring); nothing
    when the tensor-parallel group has one rank."""
    if groups.tp_group is None:
        return
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, groups)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, groups)
    if not isinstance(model.embed_tokens, nn.Identity):
        rows = model.config.vocab_size
        model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, vocab_start, rows, groups)
