"""Faster CPU matrix products for the model's linear layers, from one copy of each weight.

A decode step multiplies a few dozen rows by every weight matrix, and the weights (half a gigabyte
for the default model in float32) stream from memory once per step. :class:`PanelLinear` holds each
weight in the kernel library's panel layout (``pagedllm/kernels/csrc/linear_cpu.c``) instead of the
original ``[out, in]`` tensor, which it releases: the panel product prefetches the next panel while it
computes on the current one, 1.2-1.5x faster than MKL (plain or packed) at 8-64 rows on the default
model's layers read cold. Prompt chunks use the same kernel: on those layers at 300-4096 rows it is
2.1-2.8x faster than ``F.linear`` (MKL) on the original weight and than a batched matmul over the panels
(docs/PERFORMANCE.md, section 9). An embedding table tied to an LM head is read from the head's panels
(:class:`PanelEmbedding`), so it is not kept twice.
The Python forward and the native decode layers (:mod:`pagedllm.model.cpu_decode`) share the panels and
give the same results. Where the library cannot be built, weights are stored column-major instead,
the next best layout for small batches.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels.cpu.library import kernels_available, load_library

PANEL_WIDTH = 32  # output columns per panel (NR in linear_cpu.c)


class PanelLinear(nn.Module):
    """``F.linear`` with the weight held only in the kernel library's panel layout (float32 CPU).

    ``panels`` is packed from ``linear.weight`` once; the original weight is not kept (a module that
    shares it, such as a tied embedding, must read the panels instead: :class:`PanelEmbedding`).
    ``bias`` is the original parameter. Every product runs the panel kernel, so a row's output does not
    depend on the other rows of the batch.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or not weight.is_contiguous():
            raise ValueError("PanelLinear needs a contiguous float32 CPU weight.")
        if linear.bias is not None and not linear.bias.is_contiguous():
            raise ValueError("PanelLinear needs a contiguous bias.")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.bias = linear.bias
        lib = load_library()
        self.panels: torch.Tensor
        self.register_buffer(
            "panels",
            torch.empty(lib.panel_weight_floats(self.out_features, self.in_features), dtype=torch.float32),
            persistent=False,
        )
        lib.pack_panels_f32(weight.data_ptr(), self.out_features, self.in_features, self.panels.data_ptr())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, panels"

    def panel_view(self) -> torch.Tensor:
        """The panels as ``[num_panels, in_features, PANEL_WIDTH]`` (column ``c`` of panel ``j`` is
        output ``j * PANEL_WIDTH + c``; columns past ``out_features`` are zero)."""
        return self.panels.view(-1, self.in_features, PANEL_WIDTH)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the original ``[out, in]`` weight, gathered from the panels."""
        return self.panel_view()[ids // PANEL_WIDTH, :, ids % PANEL_WIDTH]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        x2 = x if x.dim() == 2 else x.reshape(-1, k)
        if x2.dtype != torch.float32:
            raise TypeError(f"PanelLinear takes float32 inputs, got {x2.dtype}.")
        if x2.stride(-1) != 1 or x2.stride(0) < k:
            x2 = x2.contiguous()
        rows = x2.shape[0]
        out = torch.empty(rows, n, dtype=torch.float32)
        rc = load_library().panel_linear_f32(
            x2.data_ptr(), x2.stride(0), self.panels.data_ptr(),
            None if self.bias is None else self.bias.data_ptr(), out.data_ptr(), n, rows, n, k,
        )  # fmt: skip
        if rc:
            raise MemoryError("panel_linear: out of memory for its packed rows.")
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


class PanelEmbedding(nn.Module):
    """An embedding table read from the panels of the :class:`PanelLinear` it is tied to (an LM head
    sharing the embedding's weight), so that the table is held once."""

    def __init__(self, head: PanelLinear) -> None:
        super().__init__()
        self.head = head
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token ids must be in [0, {self.num_embeddings}).")
        return self.head.weight_rows(flat).view(*ids.shape, self.embedding_dim)


def _column_major(module: nn.Linear, shared: set[int]) -> None:
    if id(module.weight) not in shared:
        module.weight.data = module.weight.data.t().contiguous().t()


def optimize_cpu_linears(model: nn.Module) -> str:
    """Swap every float32 ``nn.Linear`` of ``model`` for the fastest CPU form available.

    Returns the form used: ``"panels"`` (:class:`PanelLinear`; an ``nn.Embedding`` sharing its weight
    with a linear becomes a :class:`PanelEmbedding` of it) or, without the kernel library,
    ``"column-major"`` (weights stored ``[in, out]`` in memory, same values and shapes, which the BLAS
    multiplies up to ~2.5x faster at 16-32 rows than ``[out, in]``; weights shared with an embedding
    keep their layout).
    """
    linears = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and child.weight.dtype == torch.float32
    ]
    if kernels_available():
        embeddings = [
            (parent, name, child)
            for parent in model.modules()
            for name, child in parent.named_children()
            if isinstance(child, nn.Embedding)
        ]
        for parent, name, child in linears:
            panel = PanelLinear(child)
            setattr(parent, name, panel)
            for e_parent, e_name, embedding in embeddings:
                if embedding.weight is child.weight:
                    setattr(e_parent, e_name, PanelEmbedding(panel))
        return "panels"
    shared = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for _, _, child in linears:
        _column_major(child, shared)
    return "column-major"
