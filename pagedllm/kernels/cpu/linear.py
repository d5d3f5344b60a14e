"""Faster CPU matrix products for the model's linear layers.

A decode step multiplies a few dozen rows by every weight matrix, and the weights (half a gigabyte
for the default model in float32) stream from memory once per step. :class:`PanelLinear` keeps each
weight in the kernel library's panel layout (``pagedllm/kernels/csrc/linear_cpu.c``), whose product
prefetches the next panel while it computes on the current one; on the default model's layers, read
cold as a decode step reads them, it is 1.2-1.5x faster than MKL (plain or packed) at 8-64 rows.
Prompt chunks of more rows go to MKL on the original weights, which is faster there. The Python
forward and the native decode layers (:mod:`pagedllm.model.cpu_decode`) share the one panel copy and
give the same results. Where the library cannot be built, weights are stored column-major instead,
the next best layout for small batches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.cpu.library import kernels_available, load_library

# Above this many rows (prompt chunks) MKL on the original weights is faster: each weight is read
# once for many rows, so streaming it costs little, and MKL's blocking for large products is better.
PANEL_MAX_ROWS = 256


class PanelLinear(nn.Module):
    """``F.linear`` with the weight also held in the kernel library's panel layout (float32 CPU).

    ``weight`` and ``bias`` are the original parameters (shared, not copied: a tied LM head keeps
    pointing at the embedding table); ``panels`` is derived from ``weight`` once, so the weight must
    not change afterwards. Products of at most :data:`PANEL_MAX_ROWS` rows use the panels, larger
    ones ``F.linear``; within the panel range a row's output does not depend on the other rows.
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
        self.weight = weight
        self.bias = linear.bias
        lib = load_library()
        self.panels: torch.Tensor
        self.register_buffer(
            "panels",
            torch.empty(lib.panel_weight_floats(self.out_features, self.in_features), dtype=torch.float32),
            persistent=False,
        )
        lib.pack_panels_f32(weight.data_ptr(), self.out_features, self.in_features, self.panels.data_ptr())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        x2 = x if x.dim() == 2 else x.reshape(-1, k)
        if x2.dtype != torch.float32:
            raise TypeError(f"PanelLinear takes float32 inputs, got {x2.dtype}.")
        if x2.shape[0] > PANEL_MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
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


def _column_major(module: nn.Linear, shared: set[int]) -> None:
    if id(module.weight) not in shared:
        module.weight.data = module.weight.data.t().contiguous().t()


def optimize_cpu_linears(model: nn.Module) -> str:
    """Swap every float32 ``nn.Linear`` of ``model`` for the fastest CPU form available.

    Returns the form used: ``"panels"`` (:class:`PanelLinear`) or, without the kernel library,
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
        for parent, name, child in linears:
            setattr(parent, name, PanelLinear(child))
        return "panels"
    shared = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for _, _, child in linears:
        _column_major(child, shared)
    return "column-major"
