"""The paged decode and prefill attention kernels of the native CPU library (see
:mod:`pagedllm.kernels.cpu.library`), with an optional sliding window and logit soft-capping."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from pagedllm.kernels.cpu.library import load_library

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
# The window / soft-cap entry points: the plain kernels' arguments, then the window and the cap.
_WINDOW_KERNELS: dict[str, list[Any]] = {
    "paged_decode_attention_window_f32": [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64]
    + [_I64] * 6
    + [_F32, _I64, _F32],
    "paged_prefill_attention_window_f32": [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64]
    + [_I64] * 5
    + [_F32, _I64, _F32],
}


@functools.cache
def _kernel(name: str) -> Any:
    fn = getattr(load_library(), name)
    fn.argtypes = _WINDOW_KERNELS[name]
    fn.restype = ctypes.c_int
    return fn


def _window_args(sliding_window: int | None, soft_cap: float | None) -> tuple[int, float]:
    """The kernels' encoding: 0 for no window / no cap."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive integer, got {sliding_window}.")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"logits soft cap must be positive, got {soft_cap}.")
    return sliding_window or 0, soft_cap or 0.0


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V.

    ``query`` ``[S, H, D]`` float32 with a contiguous last dimension (other strides free);
    ``k_cache``/``v_cache`` ``[num_blocks, block_size, KVH, D]`` contiguous float32;
    ``block_tables`` ``[S, max_blocks]`` int32 with a contiguous last dimension; ``seq_lens`` ``[S]``
    int32 contiguous, each at least 1 and at most ``max_seq_len``. Returns (or fills ``out``)
    ``[S, H, D]``.

    ``sliding_window``: the query at position ``seq_len - 1`` sees only the last ``sliding_window``
    keys, and blocks wholly before them are not read. ``soft_cap``: scores become
    ``soft_cap * tanh(score / soft_cap)`` before the softmax.
    """
    window, cap = _window_args(sliding_window, soft_cap)
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
    rc = _kernel("paged_decode_attention_window_f32")(
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
        window,
        cap,
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
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> None:
    """Causal attention of prompt chunks over their paged K/V (already written), into ``out``.

    ``query``/``out`` ``[T, H, D]`` float32, contiguous along ``D`` (a multiple of 16, at most 256);
    caches as for :func:`paged_decode_attention`; ``chunks`` ``[C, 4]`` int64 contiguous, one row per
    chunk: its block table row, its first query row in ``query``, its query length and its sequence
    length (cached context plus the chunk). Rows of ``out`` outside the chunks are left untouched.
    ``sliding_window`` and ``soft_cap`` as for :func:`paged_decode_attention` (a query at position p
    sees keys ``p - sliding_window + 1 .. p``).
    """
    window, cap = _window_args(sliding_window, soft_cap)
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
    rc = _kernel("paged_prefill_attention_window_f32")(
        query.data_ptr(), query.stride(0), query.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), chunks.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1),
        n, num_heads, num_kv_heads, head_dim, block_size, scale, window, cap,
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("paged_prefill_attention: out of memory for its scratch buffers.")
