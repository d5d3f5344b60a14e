"""Batched multi-LoRA products (Triton): the shrink ``x @ A^T`` and the expand ``y += t @ B^T`` of
many adapters in one launch each ("segmented gather matrix-vector", SGMV).

The rows of a step are described by ``S`` segments: segment ``s`` is rows ``seg_starts[s]`` to
``seg_starts[s] + seg_lens[s] - 1``, all served by adapter slot ``seg_slots[s]``. Segments are
disjoint; they need not be sorted, need not cover every row (rows outside every segment are left
alone) and a slot may serve several segments.

* :func:`lora_shrink` - ``t[row] = x[row] @ lora_a[slot].T`` in float32, ``t`` being zero on rows
  outside every segment. ``lora_a`` is ``[num_slots, rank, in_features]``.
* :func:`lora_expand_add` - ``y[row] += t[row] @ lora_b[slot].T`` in place, computed and added in
  float32 and rounded once to ``y``'s dtype. ``lora_b`` is ``[num_slots, out_features, rank]``, the
  adapter's scaling already folded in.

Each kernel's grid is ``(row blocks, segments, column blocks)``: axis 0 covers
``cdiv(max_seg_len, BLOCK_M)`` blocks of rows (the axis without CUDA's 65535 limit, for long
prefills), so programs past the end of a shorter segment exit at once. Every program reads its
segment's start, length and slot from device memory: nothing is synchronised with the host, so the
launches can be captured in a CUDA graph (``max_seg_len`` only has to bound the segment lengths;
rows past it are skipped). Neither slot nor row indices are bounds-checked on the device.

The shrink loops over ``in_features`` in ``BLOCK_K`` tiles; on a GPU, when the launch has too few
programs to fill the SMs (decode), it splits ``in_features`` into chunks whose float32 partial
results are summed by torch afterwards (deterministically, no atomics). The expand's reduction is
over the rank (usually 8..64), padded to one power-of-two tile of at least 16 (``tl.dot``'s smallest).
Products of float32 operands are exact IEEE (no TF32); fp16/bf16 shrink operands go to ``tl.dot`` as
they are, the expand multiplies ``t`` with ``B`` upcast to float32 (TF32 on tensor cores). On CPU
tensors the kernels run in the Triton interpreter (see :mod:`pagedllm.kernels.triton.launch`), which
is how the tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.launch import is_interpreted, last_dim_contiguous, launch, num_sms

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# Arguments that change from step to step are not specialised on (Triton otherwise compiles a variant
# for values equal to 1 and for multiples of 16 the first time each comes up mid-run).
@triton.jit(do_not_specialize=["k_chunk", "stride_ps"])
def _lora_shrink_kernel(
    x_ptr,  # [T, K] rows of the step, unit stride along K
    a_ptr,  # [num_slots, N, K] A of every slot, unit stride along K
    out_ptr,  # [SPLIT_K, T, N] float32, zero-filled: one partial result per K chunk
    seg_starts_ptr,  # [S] int32
    seg_lens_ptr,  # [S] int32
    seg_slots_ptr,  # [S] int32
    N,  # rank
    K,  # in_features
    k_chunk,  # features per K chunk, a multiple of BLOCK_K (K itself without a split)
    n_blocks,  # cdiv(N, BLOCK_N): axis 2 enumerates (K chunk, column block) pairs
    stride_xm,
    stride_as,
    stride_an,
    stride_ps,
    stride_pm,
    IEEE_DOT: tl.constexpr,  # exact fp32 products (float32 operands)
    UPCAST_DOT: tl.constexpr,  # fp32 operands for the interpreter, which cannot multiply bf16 tiles
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Grid ``(cdiv(max_seg_len, BLOCK_M), S, SPLIT_K * n_blocks)``: rows ``[pid0 * BLOCK_M, +BLOCK_M)``
    of segment ``pid1``, columns ``[n * BLOCK_N, +BLOCK_N)`` of the rank, features of K chunk ``c``
    where ``pid2 = c * n_blocks + n``."""
    pid_m = tl.program_id(0)
    seg = tl.program_id(1)
    pid_2 = tl.program_id(2)
    seg_len = tl.load(seg_lens_ptr + seg)
    if pid_m * BLOCK_M >= seg_len:
        return
    start = tl.load(seg_starts_ptr + seg).to(tl.int64)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    chunk = pid_2 // n_blocks
    pid_n = pid_2 % n_blocks

    local = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = local < seg_len
    rows = start + local
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    k_begin = chunk * k_chunk
    k_end = tl.minimum(k_begin + k_chunk, K)

    x_rows = x_ptr + rows[:, None] * stride_xm
    a_cols = a_ptr + slot * stride_as + cols[None, :] * stride_an
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_ok = k0 + ks < k_end
        x = tl.load(x_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_cols + (k0 + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST_DOT:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        if IEEE_DOT:
            acc = tl.dot(x, a, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, a, acc)
    tl.store(
        out_ptr + chunk * stride_ps + rows[:, None] * stride_pm + cols[None, :],
        acc,
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _lora_expand_kernel(
    y_ptr,  # [T, N] updated in place, unit stride along N
    t_ptr,  # [T, R] float32 shrink output, unit stride along R
    b_ptr,  # [num_slots, N, R] B of every slot (dtype of y), unit stride along R
    seg_starts_ptr,  # [S] int32
    seg_lens_ptr,  # [S] int32
    seg_slots_ptr,  # [S] int32
    N,  # out_features
    R,  # rank
    stride_ym,
    stride_tm,
    stride_bs,
    stride_bn,
    IEEE_DOT: tl.constexpr,  # exact fp32 products (float32 B)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,  # power of two >= 16; one tile holds the whole rank when R <= BLOCK_R
):
    """Grid ``(cdiv(max_seg_len, BLOCK_M), S, cdiv(N, BLOCK_N))``: ``y[rows, cols] += t[rows] @
    b[slot, cols].T`` for rows ``[pid0 * BLOCK_M, +BLOCK_M)`` of segment ``pid1``, in float32."""
    pid_m = tl.program_id(0)
    seg = tl.program_id(1)
    pid_n = tl.program_id(2)
    seg_len = tl.load(seg_lens_ptr + seg)
    if pid_m * BLOCK_M >= seg_len:
        return
    start = tl.load(seg_starts_ptr + seg).to(tl.int64)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)

    local = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = local < seg_len
    rows = start + local
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rs = tl.arange(0, BLOCK_R)

    t_rows = t_ptr + rows[:, None] * stride_tm
    b_cols = b_ptr + slot * stride_bs + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r_ok = r0 + rs < R
        t = tl.load(t_rows + (r0 + rs)[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        b = tl.load(b_cols + (r0 + rs)[:, None], mask=r_ok[:, None] & col_ok[None, :], other=0.0)
        b = b.to(tl.float32)
        if IEEE_DOT:
            acc = tl.dot(t, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(t, b, acc)
    mask = row_ok[:, None] & col_ok[None, :]
    y_tile = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    y = tl.load(y_tile, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_tile, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------------
# Checks and launch configuration
# --------------------------------------------------------------------------------------------------


def _check_segments(
    device: torch.device,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
) -> int:
    """The number of segments, after checking the segment tensors and ``max_seg_len``."""
    for name, tensor in (("seg_starts", seg_starts), ("seg_lens", seg_lens), ("seg_slots", seg_slots)):
        if tensor.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {tensor.dtype}.")
        if tensor.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}.")
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, the activations on {device}.")
    if not seg_starts.shape[0] == seg_lens.shape[0] == seg_slots.shape[0]:
        raise ValueError(
            f"seg_starts/seg_lens/seg_slots have {seg_starts.shape[0]}/{seg_lens.shape[0]}/"
            f"{seg_slots.shape[0]} entries; they must have one per segment."
        )
    if isinstance(max_seg_len, bool) or not isinstance(max_seg_len, int) or max_seg_len < 0:
        raise ValueError(f"max_seg_len must be a non-negative int, got {max_seg_len!r}.")
    return int(seg_starts.shape[0])


def _check_float(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {tensor.dtype}.")


def _block_m(device: torch.device, max_seg_len: int) -> int:
    """Rows per program: 16 (``tl.dot``'s smallest tile) for decode, up to 64 for prefill segments."""
    cap = 64 if device.type == "cpu" or max_seg_len > 128 else 32
    return max(16, min(cap, triton.next_power_of_2(max_seg_len)))


def _rank_block(rank: int) -> int:
    """A power of two >= 16 holding the whole rank, up to 64 (larger ranks take several tiles)."""
    return max(16, min(64, triton.next_power_of_2(rank)))


def _split_k(device: torch.device, programs: int, k_tiles: int) -> int:
    """K chunks for the shrink: enough programs for about two waves of the GPU, at most 16 chunks,
    at least two K tiles per chunk. One on CPU tensors (the interpreter gains nothing from it)."""
    if device.type == "cpu":
        return 1
    want = max(1, (2 * num_sms(device)) // max(1, programs))
    return max(1, min(want, 16, k_tiles // 2))


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
) -> torch.Tensor:
    """``t`` ``[T, rank]`` float32 with ``t[row] = x[row] @ lora_a[slot].T`` for the rows of each
    segment (``slot`` being the segment's) and ``t[row] = 0`` for rows outside every segment.

    ``x`` ``[T, in_features]`` and ``lora_a`` ``[num_slots, rank, in_features]`` share one float
    dtype; ``seg_*`` are int32 ``[S]``; ``max_seg_len`` bounds ``seg_lens`` (it sizes the grid).
    """
    return _shrink(x, lora_a, seg_starts, seg_lens, seg_slots, max_seg_len)


def _shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
    *,
    split_k: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """:func:`lora_shrink`; ``split_k`` and ``block_k`` override the launch configuration (tests)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, in_features], got shape {tuple(x.shape)}.")
    if lora_a.dim() != 3:
        raise ValueError(f"lora_a must be [num_slots, rank, in_features], got shape {tuple(lora_a.shape)}.")
    if lora_a.shape[2] != x.shape[1]:
        raise ValueError(
            f"lora_a has in_features {lora_a.shape[2]} but x has {x.shape[1]} "
            f"(x {tuple(x.shape)}, lora_a {tuple(lora_a.shape)})."
        )
    _check_float("x", x)
    if lora_a.dtype != x.dtype:
        raise ValueError(f"lora_a is {lora_a.dtype} but x is {x.dtype}; they must match.")
    if lora_a.device != x.device:
        raise ValueError(f"lora_a is on {lora_a.device}, x on {x.device}.")
    num_segments = _check_segments(x.device, seg_starts, seg_lens, seg_slots, max_seg_len)
    tokens, in_features = x.shape
    rank = lora_a.shape[1]
    if tokens == 0 or num_segments == 0 or max_seg_len == 0 or rank == 0 or in_features == 0:
        return torch.zeros(tokens, rank, dtype=torch.float32, device=x.device)

    x = last_dim_contiguous(x)
    lora_a = last_dim_contiguous(lora_a)
    device = x.device
    block_m = _block_m(device, max_seg_len)
    block_n = _rank_block(rank)
    if block_k is None:
        block_k = 128 if device.type == "cpu" or block_m <= 16 else 64
    m_blocks = triton.cdiv(max_seg_len, block_m)
    n_blocks = triton.cdiv(rank, block_n)
    k_tiles = triton.cdiv(in_features, block_k)
    if split_k is None:
        split_k = _split_k(device, m_blocks * num_segments * n_blocks, k_tiles)
    tiles_per_chunk = triton.cdiv(k_tiles, max(1, min(split_k, k_tiles)))
    split_k = triton.cdiv(k_tiles, tiles_per_chunk)  # no empty chunks
    out = torch.zeros(split_k, tokens, rank, dtype=torch.float32, device=device)
    launch(
        _lora_shrink_kernel,
        (m_blocks, num_segments, split_k * n_blocks),
        device,
        x,
        lora_a,
        out,
        seg_starts,
        seg_lens,
        seg_slots,
        rank,
        in_features,
        tiles_per_chunk * block_k,
        n_blocks,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        out.stride(0),
        out.stride(1),
        IEEE_DOT=x.dtype == torch.float32,
        UPCAST_DOT=is_interpreted(_lora_shrink_kernel, device) and x.dtype != torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out[0] if split_k == 1 else out.sum(dim=0)


def lora_expand_add(
    y: torch.Tensor,
    t: torch.Tensor,
    lora_b: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
) -> None:
    """``y[row] += t[row] @ lora_b[slot].T`` in place for the rows of each segment (``slot`` being
    the segment's), computed in float32 and rounded once to ``y``'s dtype; other rows are unchanged.

    ``y`` ``[T, out_features]`` (unit stride along ``out_features``, as it is updated in place);
    ``t`` ``[T, rank]`` float32 (:func:`lora_shrink`'s output); ``lora_b`` ``[num_slots,
    out_features, rank]`` in ``y``'s dtype, the adapter's scaling already folded in; ``seg_*`` are
    int32 ``[S]``; ``max_seg_len`` bounds ``seg_lens`` (it sizes the grid).
    """
    if y.dim() != 2:
        raise ValueError(f"y must be [T, out_features], got shape {tuple(y.shape)}.")
    if t.dim() != 2:
        raise ValueError(f"t must be [T, rank], got shape {tuple(t.shape)}.")
    if lora_b.dim() != 3:
        raise ValueError(f"lora_b must be [num_slots, out_features, rank], got shape {tuple(lora_b.shape)}.")
    if t.shape[0] != y.shape[0]:
        raise ValueError(f"t has {t.shape[0]} rows but y has {y.shape[0]}.")
    if lora_b.shape[1] != y.shape[1]:
        raise ValueError(
            f"lora_b has out_features {lora_b.shape[1]} but y has {y.shape[1]} "
            f"(y {tuple(y.shape)}, lora_b {tuple(lora_b.shape)})."
        )
    if lora_b.shape[2] != t.shape[1]:
        raise ValueError(f"lora_b has rank {lora_b.shape[2]} but t has rank {t.shape[1]}.")
    _check_float("y", y)
    if lora_b.dtype != y.dtype:
        raise ValueError(f"lora_b is {lora_b.dtype} but y is {y.dtype}; they must match.")
    if t.dtype != torch.float32:
        raise ValueError(f"t must be float32 (lora_shrink's output), got {t.dtype}.")
    for name, tensor in (("t", t), ("lora_b", lora_b)):
        if tensor.device != y.device:
            raise ValueError(f"{name} is on {tensor.device}, y on {y.device}.")
    if y.stride(-1) != 1:
        raise ValueError("y must have unit stride along out_features (it is updated in place).")
    num_segments = _check_segments(y.device, seg_starts, seg_lens, seg_slots, max_seg_len)
    tokens, out_features = y.shape
    rank = t.shape[1]
    if tokens == 0 or num_segments == 0 or max_seg_len == 0 or out_features == 0 or rank == 0:
        return

    t = last_dim_contiguous(t)
    lora_b = last_dim_contiguous(lora_b)
    device = y.device
    block_m = _block_m(device, max_seg_len)
    if device.type == "cpu":
        block_n = max(16, min(256, triton.next_power_of_2(out_features)))  # few, large programs
    else:
        block_n = 64 if block_m <= 16 else 128
    launch(
        _lora_expand_kernel,
        (triton.cdiv(max_seg_len, block_m), num_segments, triton.cdiv(out_features, block_n)),
        device,
        y,
        t,
        lora_b,
        seg_starts,
        seg_lens,
        seg_slots,
        out_features,
        rank,
        y.stride(0),
        t.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        IEEE_DOT=lora_b.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=_rank_block(rank),
        num_warps=4,
    )
