"""Faster CPU matrix products for the model's linear layers.

A decode step multiplies a few dozen rows by every weight matrix, a shape at which a plain
``F.linear`` reaches a fraction of the CPU's GEMM rate. MKL can pre-pack a weight matrix into its
kernel's native layout once (``cblas_sgemm_pack``) and then multiply any number of rows by it
without re-packing; at 16-64 rows that is 1.2-1.6x faster than the best unpacked layout, with the
same results. torch exposes that through ``torch.ops.mkl``; where the build lacks it, weights are
stored column-major instead, the next best layout for small batches.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

# Below this many rows the packed kernel is slower than the plain one (measured: 1-3 rows).
_MIN_PACKED_ROWS = 4
# MKL only uses the row count to pick the packed format; any count is valid at run time.
_PACK_HINT_ROWS = 32


def mkl_packing_available() -> bool:
    ops = getattr(torch.ops, "mkl", None)
    return (
        torch.backends.mkl.is_available()
        and ops is not None
        and hasattr(ops, "_mkl_reorder_linear_weight")
        and hasattr(ops, "_mkl_linear")
    )


class PackedLinear(nn.Module):
    """``F.linear`` with the weight also held in MKL's packed layout (float32 CPU only).

    ``weight`` and ``bias`` are the original parameters (shared, not copied: a tied LM head keeps
    pointing at the embedding table); ``packed`` is derived from ``weight`` once, so the weight must
    not change afterwards.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or not weight.is_contiguous():
            raise ValueError("PackedLinear needs a contiguous float32 CPU weight.")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = weight
        self.bias = linear.bias
        self.packed: torch.Tensor
        self.register_buffer(
            "packed",
            torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), _PACK_HINT_ROWS),
            persistent=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows < _MIN_PACKED_ROWS:
            return F.linear(x, self.weight, self.bias)
        if not x.is_contiguous():
            x = x.contiguous()
        # The last argument tells the op that the weight was packed for this row count, which holds
        # for any count (see the module docstring); otherwise it falls back to F.linear.
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, rows)


def _column_major(module: nn.Linear, shared: set[int]) -> None:
    if id(module.weight) not in shared:
        module.weight.data = module.weight.data.t().contiguous().t()


def optimize_cpu_linears(model: nn.Module) -> str:
    """Swap every float32 ``nn.Linear`` of ``model`` for the fastest CPU form available.

    Returns the form used: ``"mkl-packed"`` (:class:`PackedLinear`) or ``"column-major"`` (weights
    stored ``[in, out]`` in memory, same values and shapes, which the BLAS multiplies up to ~2.5x
    faster at 16-32 rows than ``[out, in]``; weights shared with an embedding keep their layout).
    """
    linears = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and child.weight.dtype == torch.float32
    ]
    if mkl_packing_available():
        for parent, name, child in linears:
            setattr(parent, name, PackedLinear(child))
        return "mkl-packed"
    shared = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for _, _, child in linears:
        _column_major(child, shared)
    return "column-major"
