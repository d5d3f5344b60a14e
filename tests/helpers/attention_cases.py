"""Paged-attention test cases shared by the kernel tests: batches over a shuffled paged cache and a
naive float32 reference."""

from __future__ import annotations

import torch

from pagedllm.attention.base import AttentionMetadata

TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Batch:
    """A mixed batch over a paged cache whose unused slots hold NaN (they must never be read).

    ``requests`` lists ``(query_len, seq_len)``; each request gets its own physical blocks, taken in a
    shuffled order so block ids are neither contiguous nor increasing.
    """

    def __init__(
        self,
        requests: list[tuple[int, int]],
        *,
        block_size: int,
        num_kv_heads: int,
        group: int,
        head_dim: int,
        dtype: torch.dtype,
        seed: int = 0,
        padding_tokens: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.requests = requests
        self.num_heads = num_kv_heads * group
        blocks_per_req = [cdiv(s, block_size) for _, s in requests]
        num_blocks = sum(blocks_per_req) + 2
        physical = torch.randperm(num_blocks, generator=gen)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.block_tables = torch.zeros(len(requests), max(blocks_per_req), dtype=torch.int32)
        next_block = 0
        for i, (_, seq_len) in enumerate(requests):
            ids = physical[next_block : next_block + blocks_per_req[i]]
            next_block += blocks_per_req[i]
            self.block_tables[i, : len(ids)] = ids.to(torch.int32)
            for pos in range(0, seq_len, block_size):
                n = min(block_size, seq_len - pos)
                blk = int(ids[pos // block_size])
                self.k_cache[blk, :n] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
                self.v_cache[blk, :n] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        query_lens = [q for q, _ in requests]
        seq_lens = [s for _, s in requests]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        num_tokens = starts[-1] + padding_tokens
        self.query = torch.randn(num_tokens, self.num_heads, head_dim, generator=gen).to(dtype)
        self.meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=self.block_tables,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        self.scale = head_dim**-0.5


def release_blocks_before_window(batch: Batch, window: int) -> None:
    """Point every block-table entry wholly before its request's window at a NaN block, as a
    sliding-window KV cache manager that released those blocks would leave it (never to be read)."""
    block_size = batch.k_cache.shape[1]
    used = set(batch.block_tables.flatten().tolist())
    spare = next(b for b in range(batch.k_cache.shape[0]) if b not in used)  # holds NaN
    for i, (query_len, seq_len) in enumerate(batch.requests):
        first_key = max(0, seq_len - query_len - window + 1)
        batch.block_tables[i, : first_key // block_size] = spare


def reference_attention(
    batch: Batch, sliding_window: int | None = None, soft_cap: float | None = None
) -> torch.Tensor:
    """Per request: gather K/V through the block table, causal softmax attention in float32.

    ``sliding_window``: a query at position p sees keys in ``(p - window, p]``; ``soft_cap``: scores
    become ``cap * tanh(score / cap)`` before the softmax. Keys outside every query's window are
    dropped before the product, so NaN blocks there do not matter."""
    k_cache, v_cache = batch.k_cache.float(), batch.v_cache.float()
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = batch.num_heads // num_kv_heads
    out = torch.zeros(batch.query.shape, dtype=torch.float32)
    start = 0
    for i, (query_len, seq_len) in enumerate(batch.requests):
        blocks = batch.block_tables[i, : cdiv(seq_len, block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].repeat_interleave(group, dim=1)
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].repeat_interleave(group, dim=1)
        q = batch.query[start : start + query_len].float()
        first = 0 if sliding_window is None else max(0, seq_len - query_len - sliding_window + 1)
        k, v = k[first:], v[first:]
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(seq_len - query_len, seq_len)
        k_pos = torch.arange(first, seq_len)[None, :]
        visible = k_pos <= q_pos[:, None]
        if sliding_window is not None:
            visible &= k_pos > q_pos[:, None] - sliding_window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[start : start + query_len] = torch.einsum("hqk,khd->qhd", probs, v)
        start += query_len
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(actual).all(), "non-finite attention output"
    torch.testing.assert_close(actual.float(), expected, **TOLERANCES[dtype])


# Mixed batch: decodes, a fresh prefill, prefill chunks with cached prefixes (some not block aligned).
MIXED = [(1, 37), (9, 9), (5, 70), (1, 1), (17, 40), (1, 16)]


def prefill_chunks(batch: Batch) -> torch.Tensor:
    """The ``chunks`` rows of ``paged_prefill_attention`` for every request of ``batch``."""
    starts = batch.meta.query_start_loc.tolist()
    return torch.tensor([[i, starts[i], q, s] for i, (q, s) in enumerate(batch.requests)], dtype=torch.int64)
