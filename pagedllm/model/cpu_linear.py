"""Faster CPU matrix products for the model's linear layers.

A decode step multiplies a few dozen rows by every weight matrix, a shape at which a plain
``F.linear`` reaches a fraction of the CPU's GEMM rate. MKL can pre-pack a weight matrix into its
kernel's native layout once (``cblas_sgemm_pack``) and then multiply any number of rows by it
without re-packing; at 4-64 rows that is 1.2-2.5x faster than the best unpacked layout, and no
slower at one row or at prefill sizes. The kernel library runs the packed product with the MKL that
torch has loaded (see :func:`pagedllm.native.sgemm_available`), so the Python forward and the native
decode layers (:mod:`pagedllm.model.cpu_decode`) share one packed copy and give the same results.
Where that is unavailable, weights are stored column-major instead, the next best layout for small
batches.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.native import load_library, sgemm_available


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
        if not sgemm_available():
            raise RuntimeError("MKL packed SGEMM is not available (see pagedllm.native.sgemm_available).")
        if linear.bias is not None and not linear.bias.is_contiguous():
            raise ValueError("PackedLinear needs a contiguous bias.")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = weight
        self.bias = linear.bias
        lib = load_library()
        size = lib.packed_weight_bytes(self.out_features, self.in_features)
        self.packed: torch.Tensor
        self.register_buffer("packed", torch.empty(size // 4 + 1, dtype=torch.float32), persistent=False)
        lib.pack_weight_f32(weight.data_ptr(), self.out_features, self.in_features, self.packed.data_ptr())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        x2 = x if x.dim() == 2 else x.reshape(-1, k)
        if x2.stride(-1) != 1 or x2.stride(0) < k:
            x2 = x2.contiguous()
        rows = x2.shape[0]
        out = torch.empty(rows, n, dtype=torch.float32)
        if rows:
            load_library().packed_linear_f32(
                x2.data_ptr(), x2.stride(0), self.packed.data_ptr(),
                None if self.bias is None else self.bias.data_ptr(), out.data_ptr(), n, rows, n, k,
            )  # fmt: skip
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


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
    if sgemm_available():
        for parent, name, child in linears:
            setattr(parent, name, PackedLinear(child))
        return "mkl-packed"
    shared = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for _, _, child in linears:
        _column_major(child, shared)
    return "column-major"
