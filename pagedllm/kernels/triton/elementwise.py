"""Fused Triton kernels for the elementwise parts of a decoder layer, with torch fallbacks.

* :func:`rms_norm` - ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)``.
* :func:`fused_add_rms_norm` - ``residual = x + residual`` then :func:`rms_norm` of it, in one pass.
* :func:`silu_and_mul` - ``silu(x[..., :d]) * x[..., d:]``.

The kernels follow the torch formulas of :mod:`pagedllm.model.layers` step by step, rounding
intermediate values to the input dtype where torch does, so both paths agree up to the last-bit
differences of fp32 ``exp``/``rsqrt`` implementations.
Triton runs on CUDA tensors (when triton is installed; on meta tensors it compiles for a GPU inside
:func:`pagedllm.kernels.triton.aot.compile_for`); float32 CPU tensors use the native kernels of
:mod:`pagedllm.kernels.cpu.ops` when they build, other tensors torch, unless ``use_triton=True`` asks for
the Triton interpreter (for tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.kernels.cpu import ops as cpu_ops

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None  # type: ignore[assignment]


def _use_triton(x: torch.Tensor, use_triton: bool | None) -> bool:
    if triton is None:
        return False
    # Meta tensors: launches compile for a GPU inside triton_aot.compile_for, else do nothing.
    return x.device.type in ("cuda", "meta") if use_triton is None else use_triton


# --------------------------------------------------------------------------------------------------
# torch references
# --------------------------------------------------------------------------------------------------


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        out_ptr,
        residual_out_ptr,
        x_ptr,
        residual_ptr,
        weight_ptr,
        hidden,
        eps,
        stride_x,
        stride_res,
        stride_out,
        stride_res_out,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Grid ``(num_rows,)``: one program normalises one row of ``hidden <= BLOCK`` elements."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            res = tl.load(residual_ptr + row * stride_res + cols, mask=mask, other=0.0)
            # The sum is rounded to the activation dtype, as the torch add does.
            x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(residual_out_ptr + row * stride_res_out + cols, x, mask=mask)
        x32 = x.to(tl.float32)
        mean_sq = tl.sum(x32 * x32, axis=0) / hidden
        normed = (x32 * tl.rsqrt(mean_sq + eps)).to(x_ptr.dtype.element_ty)
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
        out = weight.to(tl.float32) * normed.to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_and_mul_kernel(
        out_ptr,
        x_ptr,
        d,
        stride_x,
        stride_out,
        BLOCK: tl.constexpr,
    ):
        """Grid ``(num_rows, cdiv(d, BLOCK))``."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < d
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
        act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)
        out = act.to(tl.float32) * up.to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D ``[rows, hidden]`` view with unit stride along hidden."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm_launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    from pagedllm.kernels.triton.launch import launch

    hidden = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty_like(x2)
    res2 = _rows(residual) if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else out
    block = triton.next_power_of_2(hidden)
    launch(
        _rms_norm_kernel,
        (x2.shape[0],),
        x.device,
        out,
        res_out,
        x2,
        res2,
        weight,
        hidden,
        eps,
        x2.stride(0),
        res2.stride(0),
        out.stride(0),
        res_out.stride(0),
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    return out.view(x.shape), (res_out.view(x.shape) if residual is not None else None)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, use_triton: bool | None = None
) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (any leading shape)."""
    if x.numel() == 0 or not _use_triton(x, use_triton):
        if x.numel() and cpu_ops.usable(x, weight):
            return cpu_ops.rms_norm(x, weight, eps)[0]
        return rms_norm_torch(x, weight, eps)
    out, _ = _norm_launch(x, None, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` - the pre-norm block's add-then-normalise."""
    if x.numel() == 0 or not _use_triton(x, use_triton):
        if x.numel() and cpu_ops.usable(x, residual, weight):
            out, summed = cpu_ops.rms_norm(x, weight, eps, residual)
            assert summed is not None
            return out, summed
        summed = x + residual
        return rms_norm_torch(summed, weight, eps), summed
    out, launched_residual = _norm_launch(x, residual, weight, eps)
    assert launched_residual is not None
    return out, launched_residual


def silu_and_mul(x: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """``silu(gate) * up`` where ``x = [gate, up]`` along the last dimension."""
    if x.numel() == 0 or not _use_triton(x, use_triton):
        if x.numel() and cpu_ops.usable(x):
            return cpu_ops.silu_and_mul(x)
        return silu_and_mul_torch(x)
    from pagedllm.kernels.triton.launch import launch

    d = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(d), 16384 if x.device.type == "cpu" else 1024)
    launch(
        _silu_and_mul_kernel,
        (x2.shape[0], triton.cdiv(d, block)),
        x.device,
        out,
        x2,
        d,
        x2.stride(0),
        out.stride(0),
        BLOCK=block,
        num_warps=4,
    )
    return out.view(*x.shape[:-1], d)
