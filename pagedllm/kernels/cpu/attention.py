"""The paged decode attention kernel of the native CPU library (see :mod:`pagedllm.kernels.cpu.library`)."""

from __future__ import annotations

import torch

from pagedllm.kernels.cpu.library import load_library


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V.

    ``query`` ``[S, H, D]`` float32 with a contiguous last dimension (other strides free);
    ``k_cache``/``v_cache`` ``[num_blocks, block_size, KVH, D]`` contiguous float32;
    ``block_tables`` ``[S, max_blocks]`` int32 with a contiguous last dimension; ``seq_lens`` ``[S]``
    int32 contiguous, each at least 1 and at most ``max_seq_len``. Returns (or fills ``out``)
    ``[S, H, D]``.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError("query and cache head shapes do not match.")
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"{name} must be a float32 CPU tensor.")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and query.stride(-1) == 1):
        raise ValueError("caches must be contiguous and query contiguous along head_dim.")
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be int32, contiguous along the last dimension.")
    if seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
        raise ValueError("seq_lens must be a contiguous int32 tensor.")
    if out is None:
        out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float32)
    elif out.shape != query.shape or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError("out must be a float32 tensor shaped like query, contiguous along head_dim.")
    if num_seqs == 0:
        return out
    rc = load_library().paged_decode_attention_f32(
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        max_seq_len,
        scale,
    )
    if rc != 0:
        raise MemoryError("paged_decode_attention: out of memory for its score buffers.")
    return out


def prefill_kernel_supports(head_dim: int) -> bool:
    """Whether :func:`paged_prefill_attention` takes this head size (a multiple of 16, at most 256)."""
    return head_dim % 16 == 0 and head_dim <= 256


def paged_prefill_attention(
    query: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    chunks: torch.Tensor,
    scale: float,
) -> None:
    """Causal attention of prompt chunks over their paged K/V (already written), into ``out``.

    ``query``/``out`` ``[T, H, D]`` float32, contiguous along ``D`` (a multiple of 16, at most 256);
    caches as for :func:`paged_decode_attention`; ``chunks`` ``[C, 4]`` int64 contiguous, one row per
    chunk: its block table row, its first query row in ``query``, its query length and its sequence
    length (cached context plus the chunk). Rows of ``out`` outside the chunks are left untouched.
    """
    num_heads, head_dim = query.shape[1:]
    num_blocks, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads or not prefill_kernel_supports(head_dim):
        raise ValueError("query and cache head shapes do not match, or head_dim is not a multiple of 16.")
    for name, t in (("query", query), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"{name} must be a float32 CPU tensor.")
    if not (
        k_cache.is_contiguous() and v_cache.is_contiguous() and query.stride(-1) == 1 and out.stride(-1) == 1
    ):
        raise ValueError("caches must be contiguous, query and out contiguous along head_dim.")
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be int32, contiguous along the last dimension.")
    if chunks.dtype != torch.int64 or not chunks.is_contiguous() or chunks.shape[-1:] != (4,):
        raise ValueError("chunks must be a contiguous [C, 4] int64 tensor.")
    n = chunks.shape[0]
    if n == 0:
        return
    rc = load_library().paged_prefill_attention_f32(
        query.data_ptr(), query.stride(0), query.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), chunks.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1),
        n, num_heads, num_kv_heads, head_dim, block_size, scale,
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("paged_prefill_attention: out of memory for its scratch buffers.")
