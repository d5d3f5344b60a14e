"""Triton paged attention over mixed batches (prefill chunks with cached prefixes, and decodes).

Two kernels:

* ``_paged_attention_kernel`` computes causal attention for every query token of a mixed batch
  directly from the paged cache. One program owns a tile of
  ``BLOCK_M`` rows made of ``BLOCK_Q`` consecutive query tokens of one request times the
  ``QUERIES_PER_KV`` query heads that share one KV head, so every K/V tile it loads is reused by the
  whole head group (GQA). It walks the request's context in tiles of ``TILE_N`` positions, looking up
  the physical block of every position in the block table (the tile size is independent of the cache
  block size), and keeps an online softmax with fp32 accumulators.
  The grid's third axis splits the context into ``NUM_SPLITS`` contiguous ranges (split-K, as in
  flash-decoding); with more than one split every program writes a partial result and its
  log-sum-exp, and ``_merge_splits_kernel`` combines them.
  A sliding window (``SLIDING_WINDOW`` > 0, a compile-time constant per layer) starts the walk at
  the tile holding the first key any row of the program sees, and masks the loads of positions
  before it, so blocks wholly before the window are never read. Logit soft-capping
  (``USE_SOFT_CAP``) maps scaled scores to ``cap * tanh(score / cap)`` before the softmax.
* ``_merge_splits_kernel`` merges the per-split partial outputs of each (token, head).

The KV write is in :mod:`pagedllm.kernels.triton.kv_write`. All kernels take element strides, so
caches and queries may be views, and compute in fp32 whatever the storage dtype (fp32, fp16, bf16).
On CPU tensors they run under the Triton interpreter (see :mod:`pagedllm.kernels.triton.launch`).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from pagedllm.kernels.attention_metadata import AttentionMetadata
from pagedllm.kernels.triton.launch import is_interpreted, last_dim_contiguous, launch, num_sms

# log2(e): the kernels work with exp2, so scores are scaled by softmax_scale * LOG2E.
LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_seqs", "stride_bt_seq"])
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, HEAD_DIM]; written when NUM_SPLITS == 1
    part_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM] fp32; written when NUM_SPLITS > 1
    part_lse_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32 (log2 domain)
    query_ptr,  # [num_tokens, num_heads, HEAD_DIM], in the cache dtype
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    qk_scale,  # softmax scale * log2(e)
    soft_cap,  # logit soft cap * log2(e) (read when USE_SOFT_CAP)
    num_seqs,
    num_heads,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    stride_bt_seq,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DECODE_ONLY: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr = 0,
    USE_SOFT_CAP: tl.constexpr = False,
):
    """Grid ``(num_q_programs, num_kv_heads, NUM_SPLITS)``.

    Axis 0 enumerates query tiles. In a decode-only batch (``DECODE_ONLY``) tile ``i`` is request
    ``i``. Otherwise request ``r`` owns tiles ``query_start_loc[r] // BLOCK_Q + r`` onwards (an upper
    bound on the tiles of the requests before it), found by binary search; surplus tiles exit at once.
    ``IEEE_DOT`` asks for exact fp32 products (no TF32) with fp32 caches. ``UPCAST_DOT`` feeds
    ``tl.dot`` fp32 operands holding the same values; the interpreter needs it, as it cannot multiply
    bf16 matrices.
    """
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if DECODE_ONLY:
        seq = q_tile
        q_tile_local = 0
    else:
        lo: tl.int32 = 0
        hi: tl.int32 = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
            if first_tile <= q_tile:
                lo = mid + 1
            else:
                hi = mid
        seq = lo - 1
        q_tile_local = q_tile - (tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # Row r of the tile is query token q_tile_local * BLOCK_Q + r // QUERIES_PER_KV of the request,
    # head kv_head * QUERIES_PER_KV + r % QUERIES_PER_KV.
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile_local * BLOCK_Q + rows // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_valid = (rows < BLOCK_Q * QUERIES_PER_KV) & (q_idx < q_len)
    token = (q_start + q_idx).to(tl.int64)
    q_pos = context_len + q_idx
    dims = tl.arange(0, HEAD_DIM)

    q = tl.load(
        query_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)

    # Positions [kv_start, kv_end) are visible to at least one row of the tile.
    kv_end = context_len + tl.minimum((q_tile_local + 1) * BLOCK_Q, q_len)
    if SLIDING_WINDOW > 0:
        kv_start = tl.maximum(context_len + q_tile_local * BLOCK_Q - SLIDING_WINDOW + 1, 0)
    else:
        kv_start = 0
    first_tile = kv_start // TILE_N
    num_tiles = (kv_end + TILE_N - 1) // TILE_N
    tiles_per_split = (num_tiles - first_tile + NUM_SPLITS - 1) // NUM_SPLITS
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_head = k_cache_ptr + kv_head * stride_kc_head
    v_head = v_cache_ptr + kv_head * stride_vc_head

    for t in range(tile_lo, tile_hi):
        pos = t * TILE_N + tl.arange(0, TILE_N)
        pos_valid = (pos < kv_end) & (pos >= kv_start)
        block = tl.load(block_table + pos // BLOCK_SIZE, mask=pos_valid, other=0).to(tl.int64)
        in_block = pos % BLOCK_SIZE
        k = tl.load(
            k_head + block[:, None] * stride_kc_block + in_block[:, None] * stride_kc_slot + dims[None, :],
            mask=pos_valid[:, None],
            other=0.0,
        )
        v = tl.load(
            v_head + block[:, None] * stride_vc_block + in_block[:, None] * stride_vc_slot + dims[None, :],
            mask=pos_valid[:, None],
            other=0.0,
        )
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale
        if USE_SOFT_CAP:
            # cap * tanh(x / cap) in the log2 domain (s = x log2(e), soft_cap = cap log2(e)), with
            # tanh(y) = 1 - 2 / (e^(2y) + 1) and e^(2y) = 2^(2y log2(e)).
            s = soft_cap * (1.0 - 2.0 / (tl.exp2(s * (2.0 * 1.4426950408889634 / soft_cap)) + 1.0))
        visible = (pos[None, :] <= q_pos[:, None]) & pos_valid[None, :]
        if SLIDING_WINDOW > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with nothing visible yet keeps m = -inf; shift by 0 instead to avoid inf - inf.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # P is rounded to the cache dtype, as tensor-core kernels do.
        p_dot = p.to(v_cache_ptr.dtype.element_ty)
        if UPCAST_DOT:
            p_dot = p_dot.to(tl.float32)
        acc = acc * alpha[:, None]
        if IEEE_DOT:
            acc = tl.dot(p_dot, v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p_dot, v, acc)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None],
        )
    else:
        # Empty splits (l == 0) store lse = -inf and a zero output, which the merge weights by 0.
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        part = (token * num_heads + head) * NUM_SPLITS + split
        tl.store(part_lse_ptr + part, lse, mask=row_valid)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=row_valid[:, None])


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    part_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM] fp32
    part_lse_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32 (log2 domain)
    num_heads,
    stride_o_tok,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Grid ``(num_tokens, cdiv(num_heads, BLOCK_H))``: out = sum_s w_s * out_s, w = softmax(lse)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_valid = head < num_heads
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    row = token * num_heads + head  # [BLOCK_H]

    lse = tl.load(
        part_lse_ptr + row[:, None] * NUM_SPLITS + splits[None, :],
        mask=head_valid[:, None],
        other=float("-inf"),
    )
    m = tl.max(lse, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.sum(tl.exp2(lse - m[:, None]), axis=1)
    denom = tl.where(denom == 0.0, 1.0, denom)

    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        lse_s = tl.load(part_lse_ptr + row * NUM_SPLITS + s, mask=head_valid, other=float("-inf"))
        out_s = tl.load(
            part_out_ptr + (row[:, None] * NUM_SPLITS + s) * HEAD_DIM + dims[None, :],
            mask=head_valid[:, None],
            other=0.0,
        )
        acc += tl.exp2(lse_s - m)[:, None] * out_s
    out = acc / denom[:, None]
    tl.store(
        out_ptr + token * stride_o_tok + head[:, None] * stride_o_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=head_valid[:, None],
    )


@dataclasses.dataclass(frozen=True)
class AttentionLaunchConfig:
    """Tiling of one ``paged_attention`` launch.

    ``block_m``: rows per program (query tokens x query heads of one KV head group), a power of two.
    ``tile_n``: context positions per inner iteration, a power of two. ``num_splits``: context splits
    (1 disables the merge pass), a power of two.
    """

    block_m: int
    tile_n: int
    num_splits: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "tile_n", "num_splits"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a positive power of two, got {value}.")


def num_query_programs(meta: AttentionMetadata, block_q: int) -> int:
    """Size of the attention grid's first axis: one program per request in a decode-only batch, else
    an upper bound on the number of ``block_q``-token query tiles (surplus programs exit at once)."""
    if meta.max_query_len == 1:
        return meta.num_seqs
    return sum(meta.query_lens_cpu) // block_q + meta.num_seqs


def choose_config(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    block_m: int | None = None,
    tile_n: int | None = None,
    num_splits: int | None = None,
) -> AttentionLaunchConfig:
    """Pick the tiling for a batch from host-side metadata only (no device sync)."""
    _, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    on_gpu = query.device.type != "cpu"  # cuda, or meta when compiling for a GPU
    wide = k_cache.element_size() >= 4 or head_dim > 128  # fp32 or large heads: smaller tiles

    if block_m is None:
        # Prefill tiles pack several query tokens so each K/V tile is reused; decodes need only the
        # head group (tl.dot wants at least 16 rows).
        big = 32 if (wide and on_gpu) else 64
        block_m = big if meta.max_query_len * group >= big else 16
        block_m = max(block_m, triton.next_power_of_2(group))
    if tile_n is None:
        tile_n = 32 if (wide and on_gpu) else 64
    if num_splits is None:
        num_splits = 1
        if on_gpu:
            # Split the context when the batch alone cannot fill the GPU, keeping >= 4 tiles per split.
            programs = num_query_programs(meta, block_m // group) * num_kv_heads
            target = 2 * num_sms(query.device)
            max_tiles = triton.cdiv(meta.max_seq_len, tile_n)
            want = min(triton.cdiv(target, max(programs, 1)), max_tiles // 4, 16)
            num_splits = triton.next_power_of_2(want) if want > 1 else 1
    if block_m < group:
        raise ValueError(f"block_m={block_m} cannot hold a group of {group} query heads.")
    if on_gpu and (block_m < 16 or tile_n < 16):
        raise ValueError("block_m and tile_n must be at least 16 on GPU (tl.dot tiles).")
    return AttentionLaunchConfig(block_m=block_m, tile_n=tile_n, num_splits=num_splits)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    config: AttentionLaunchConfig | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of ``query`` ``[num_tokens, num_heads, head_dim]`` over the paged caches.

    Without ``out``, rows of ``query`` past ``query_start_loc[-1]`` (batch padding) come back as
    zeros; a given ``out`` keeps whatever those rows held. ``sliding_window``: a query at position p
    sees keys ``p - sliding_window + 1 .. p`` (blocks wholly before that are not read);
    ``soft_cap``: scores become ``soft_cap * tanh(score / soft_cap)`` before the softmax.
    """
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive integer, got {sliding_window}.")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"logits soft cap must be positive, got {soft_cap}.")
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"query heads/dim {num_heads}/{head_dim} incompatible with cache {num_kv_heads}/{cache_head_dim}."
        )
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}.")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("KV caches must be contiguous along head_dim.")
    out_dtype = query.dtype
    query = last_dim_contiguous(query.to(k_cache.dtype))
    block_tables = last_dim_contiguous(meta.block_tables)
    num_real_tokens = sum(meta.query_lens_cpu)
    if out is None:
        alloc = torch.empty if num_real_tokens == num_tokens else torch.zeros
        out = alloc(num_tokens, num_heads, head_dim, dtype=out_dtype, device=query.device)
    if num_real_tokens == 0:
        return out
    cfg = config or choose_config(query, k_cache, meta)
    group = num_heads // num_kv_heads
    if cfg.block_m < group:
        raise ValueError(f"block_m={cfg.block_m} cannot hold a group of {group} query heads.")
    block_q = cfg.block_m // group
    decode_only = meta.max_query_len == 1
    num_q_programs = num_query_programs(meta, block_q)

    device = query.device
    if cfg.num_splits > 1:
        part_out = torch.empty(
            num_real_tokens, num_heads, cfg.num_splits, head_dim, dtype=torch.float32, device=device
        )
        part_lse = torch.empty(num_real_tokens, num_heads, cfg.num_splits, dtype=torch.float32, device=device)
    else:
        part_out = part_lse = out  # unused by the kernel

    launch(
        _paged_attention_kernel,
        (num_q_programs, num_kv_heads, cfg.num_splits),
        device,
        out,
        part_out,
        part_lse,
        query,
        k_cache,
        v_cache,
        block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale * LOG2E,
        (soft_cap or 1.0) * LOG2E,
        meta.num_seqs,
        num_heads,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        QUERIES_PER_KV=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m,
        BLOCK_Q=block_q,
        TILE_N=cfg.tile_n,
        NUM_SPLITS=cfg.num_splits,
        DECODE_ONLY=decode_only,
        IEEE_DOT=k_cache.dtype == torch.float32,
        UPCAST_DOT=is_interpreted(_paged_attention_kernel, device),
        SLIDING_WINDOW=sliding_window or 0,
        USE_SOFT_CAP=soft_cap is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if cfg.num_splits > 1:
        if device.type == "cpu":
            block_h = triton.next_power_of_2(num_heads)
        else:
            block_h = max(1, min(triton.next_power_of_2(num_heads), 2048 // head_dim))
        launch(
            _merge_splits_kernel,
            (num_real_tokens, triton.cdiv(num_heads, block_h)),
            device,
            out,
            part_out,
            part_lse,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            NUM_SPLITS=cfg.num_splits,
            BLOCK_H=block_h,
            num_warps=4,
        )
    return out
