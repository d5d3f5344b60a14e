"""Linear and embedding layers over GGUF-quantized weights, for the CPU.

:class:`QuantLinear` is an ``nn.Linear`` whose weight stays in its GGUF blocks
(:class:`~pagedllm.kernels.cpu.quant.QuantizedWeight`); :class:`QuantEmbedding` is an ``nn.Embedding``
over such a table, and a tied LM head is a :class:`QuantLinear` over the very same blocks (one copy).
Every product runs :func:`quant_matmul` on the blocks, on the path each row's kind picks
(:mod:`pagedllm.kernels.cpu.row_paths`): prompt rows on the AMX tiles where the CPU has them (a panel
of the weight dequantized to bfloat16 at a time, never the whole weight), every other row on the
integer kernels; a step with both runs one product per path. On each path a row's result is
independent of the other rows of its batch, so a token's result depends on the token alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pagedllm.kernels.cpu.quant import QuantizedWeight, gather_rows, quant_matmul
from pagedllm.kernels.cpu.row_paths import current_split


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b``'s bytes start where ``a``'s end, in the same storage (a file's mapping)."""
    return (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.data_ptr() + a.numel() == b.data_ptr()
    )


def _merge_parts(parts: Sequence[QuantizedWeight]) -> list[QuantizedWeight]:
    """Adjacent parts of one type whose blocks lie one after the other in one storage (tensors next to
    each other in a GGUF file, mapped) joined into one weight: a view of both, nothing copied. Other
    parts stay apart (a copy to join them would hold the weight twice while loading)."""
    merged: list[QuantizedWeight] = []
    for part in parts:
        last = merged[-1] if merged else None
        if last is None or last.type_name != part.type_name or not _follows(last.blocks, part.blocks):
            merged.append(part)
            continue
        rows = last.out_features + part.out_features
        width = last.blocks.shape[1]
        blocks = torch.empty(0, dtype=torch.uint8).set_(
            last.blocks.untyped_storage(), last.blocks.storage_offset(), (rows, width), (width, 1)
        )
        merged[-1] = QuantizedWeight(part.type_name, (rows, part.in_features), blocks)
    return merged


class QuantLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` with ``W`` in GGUF blocks, float32 activations on the CPU.

    ``parts`` are weights of the same ``in_features`` stacked along the outputs in order (a fused
    q/k/v projection whose q, k and v were quantized separately); adjacent parts of one type whose
    blocks follow each other in memory are merged (a view), the others multiplied one by one into
    their columns of the output. ``bias``, when asked for, is a float32 parameter (filled by the checkpoint loader). The
    blocks are read-only after construction and shared with any other layer built on the same
    :class:`QuantizedWeight` (a tied LM head and its :class:`QuantEmbedding`).
    """

    def __init__(self, parts: Sequence[QuantizedWeight], bias: bool = False) -> None:
        super().__init__()
        if not parts:
            raise ValueError("QuantLinear needs at least one weight.")
        in_features = {p.in_features for p in parts}
        if len(in_features) != 1:
            raise ValueError(f"QuantLinear parts have different input sizes: {sorted(in_features)}.")
        self.parts = _merge_parts(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in self.parts)
        self.bias: nn.Parameter | None = nn.Parameter(torch.zeros(self.out_features)) if bias else None

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized blocks."""
        return sum(p.nbytes for p in self.parts)

    def extra_repr(self) -> str:
        types = "+".join(p.type_name for p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, type={types}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T (+ bias)``; the rows marked as prompt rows (:func:`~pagedllm.kernels.cpu.row_paths.
        prompt_rows`) on the AMX tiles, the others on the integer kernels."""
        k, n = self.in_features, self.out_features
        x2 = x if x.dim() == 2 else x.reshape(-1, k)
        rows = x2.shape[0]
        split = current_split()
        if split is not None and split.num_rows != rows:
            raise RuntimeError(
                f"QuantLinear got {rows} rows inside a prompt-row mark for {split.num_rows}: its rows' "
                "paths are unknown."
            )
        out = torch.empty(rows, n, dtype=torch.float32)
        if split is None or split.prompt is None:
            self._product(x2, out, amx=False)
        elif split.other is None:
            self._product(x2, out, amx=True)
        else:
            for index, amx in ((split.prompt, True), (split.other, False)):
                if isinstance(index, slice):
                    self._product(x2[index], out[index], amx=amx)
                else:
                    out.index_copy_(0, index, self._product(x2.index_select(0, index), None, amx=amx))
        if self.bias is not None:
            out += self.bias
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)

    def _product(self, x2: torch.Tensor, out: torch.Tensor | None, *, amx: bool) -> torch.Tensor:
        """``x2 @ W.T`` (no bias) on one path, into ``out`` (a row range of the layer's output) or a
        fresh tensor."""
        if out is None:
            out = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        col = 0
        for part in self.parts:
            quant_matmul(x2, part, out=out[:, col : col + part.out_features], amx=amx)
            col += part.out_features
        return out


class QuantEmbedding(nn.Module):
    """Token embeddings looked up in a GGUF-quantized table ``[num_embeddings, embedding_dim]``: each
    row is dequantized as it is read (float32, bitwise as ``gguf.quants.dequantize``)."""

    def __init__(self, weight: QuantizedWeight) -> None:
        super().__init__()
        self.table = weight
        self.num_embeddings, self.embedding_dim = weight.shape

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.table.type_name}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return gather_rows(self.table, ids)
