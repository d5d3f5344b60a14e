"""Fused CPU (float32) forms of RMSNorm, SiLU-and-mul, rotary embedding and the sampler's row
max / logsumexp, from the native kernels.

Each replaces several torch ops (and their temporaries) by one pass over each row; they compute
the formulas of :mod:`pagedllm.kernels.triton.elementwise`'s torch references, up to float rounding.
:func:`usable` says whether a tensor can take this path (CPU, float32, kernels built).
"""

from __future__ import annotations

import torch

from pagedllm.kernels.cpu.library import kernels_available, load_library


def usable(*tensors: torch.Tensor) -> bool:
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu":
            return False
    return kernels_available()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last]`` with unit stride along the last dimension (a view when possible)."""
    if x.dim() == 2 and x.stride(1) == 1:  # the common case, without the cost of a reshape
        return x
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _as_shape(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return out if like.dim() == 2 else out.view(like.shape)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rms_norm(s), s)`` with ``s = x + residual``, or ``(rms_norm(x), None)`` without a residual."""
    rows, hidden = x.numel() // x.shape[-1], x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(rows, hidden, dtype=torch.float32)
    if not weight.is_contiguous():
        weight = weight.contiguous()
    res2 = res_out = None
    if residual is not None:
        res2 = _rows(residual)
        res_out = torch.empty(rows, hidden, dtype=torch.float32)
    load_library().rms_norm_f32(
        x2.data_ptr(), x2.stride(0),
        None if res2 is None else res2.data_ptr(), 0 if res2 is None else res2.stride(0),
        out.data_ptr(), hidden, None if res_out is None else res_out.data_ptr(), hidden,
        weight.data_ptr(), rows, hidden, eps,
    )  # fmt: skip
    return _as_shape(out, x), None if res_out is None else _as_shape(res_out, x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]``."""
    d = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty(x2.shape[0], d, dtype=torch.float32)
    load_library().silu_and_mul_f32(x2.data_ptr(), x2.stride(0), out.data_ptr(), d, x2.shape[0], d)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], d)


def rotary_(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, D]`` in place (its last dimension contiguous) and return it.

    ``positions`` ``[T]`` int64 index rows of ``cos``/``sin`` ``[max_pos, D / 2]`` (float32,
    contiguous); positions must be in range (the caller's invariant). The rotated pairs are
    ``(i, i + D / 2)``, or ``(2i, 2i + 1)`` with ``interleaved``.
    """
    t, heads, d = x.shape
    if x.stride(-1) != 1:
        raise ValueError("rotary_ needs x contiguous along head_dim.")
    if positions.dtype != torch.int64 or not positions.is_contiguous():
        positions = positions.to(torch.int64).contiguous()
    if not (cos.is_contiguous() and sin.is_contiguous()):
        cos, sin = cos.contiguous(), sin.contiguous()
    load_library().rotary_f32(
        x.data_ptr(),
        x.stride(0),
        x.stride(1),
        t,
        heads,
        d,
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        int(interleaved),
    )
    return x


def max_logsumexp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of ``x`` ``[rows, n]``: ``(max, first argmax, logsumexp)`` in one pass over the row
    (two over cache-resident data) instead of torch's separate reductions."""
    x2 = _rows(x)
    rows, n = x2.shape
    best = torch.empty(rows, dtype=torch.float32)
    index = torch.empty(rows, dtype=torch.int64)
    lse = torch.empty(rows, dtype=torch.float32)
    if rows:
        load_library().max_logsumexp_f32(
            x2.data_ptr(), x2.stride(0), rows, n, best.data_ptr(), index.data_ptr(), lse.data_ptr()
        )
    return best, index, lse


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to ``-inf``, in place, the logits of ``rows`` whose token bit is 0 in the row of ``bitmask``
    (int32, 32 tokens per word, xgrammar's layout) with the same index."""
    vocab = logits.shape[-1]
    if logits.dim() != 2 or logits.stride(1) != 1 or bitmask.dtype != torch.int32 or bitmask.stride(1) != 1:
        raise ValueError("apply_token_bitmask needs 2-D row-major float32 logits and int32 bitmask")
    if bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words cannot cover {vocab} tokens")
    index = torch.tensor(rows, dtype=torch.int64)
    load_library().apply_token_bitmask_f32(
        logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.stride(0),
        index.data_ptr(), len(rows), vocab,
    )  # fmt: skip
