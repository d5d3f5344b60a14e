"""The native prefill kernel on long contexts: keys in tiles of 256 with an online softmax, contexts
split into spans of 2,048 keys and merged. Against the float32 reference, and a row's result bitwise
the same whatever chunk, step or thread count computes it."""

from __future__ import annotations

import pytest
import torch

from helpers.attention_cases import (
    Batch,
    assert_close,
    prefill_chunks,
    reference_attention,
    release_blocks_before_window,
)
from pagedllm.kernels.cpu.attention import paged_prefill_attention
from pagedllm.kernels.cpu.library import kernels_available

needs_kernels = pytest.mark.skipif(not kernels_available(), reason="native CPU kernels unavailable")

# (query_len, seq_len): chunks deep in a context that cross tile (256) and span (2,048) boundaries,
# one ending on a span boundary, one-token chunks past a boundary, and a whole 2,300-token prompt.
LONG = [(16, 4500), (70, 2100), (1, 2049), (300, 2600), (33, 2048), (1, 6145), (2300, 2300)]


def run(
    batch: Batch, rows: torch.Tensor, window: int | None = None, soft_cap: float | None = None
) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))
    paged_prefill_attention(
        batch.query,
        out,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        rows,
        batch.scale,
        sliding_window=window,
        soft_cap=soft_cap,
    )
    return out


@needs_kernels
@pytest.mark.parametrize(
    ("window", "soft_cap"), [(None, None), (700, None), (3000, 30.0)], ids=["full", "window", "window-cap"]
)
def test_long_contexts_match_the_reference(window: int | None, soft_cap: float | None) -> None:
    batch = Batch(LONG, block_size=16, num_kv_heads=2, group=3, head_dim=64, dtype=torch.float32)
    if window is not None:
        release_blocks_before_window(batch, window)  # blocks out of the window hold NaN
    out = run(batch, prefill_chunks(batch), window, soft_cap)
    expected = reference_attention(batch, sliding_window=window, soft_cap=soft_cap)
    assert_close(out, expected, torch.float32)


@needs_kernels
@pytest.mark.parametrize("window", [None, 900])
def test_a_rows_result_does_not_depend_on_its_chunk_or_the_thread_count(window: int | None) -> None:
    length = 4700
    batch = Batch(
        [(length, length)], block_size=16, num_kv_heads=2, group=2, head_dim=32, dtype=torch.float32
    )
    whole = run(batch, torch.tensor([[0, 0, length, length]]), window)
    assert_close(whole, reference_attention(batch, sliding_window=window), torch.float32)
    # The same prompt in chunks ending mid-tile, on a span boundary, and one token at a time.
    cuts = [0, 1000, 2048, 2049, 2300, 4096, 4700]
    rows = torch.tensor([[0, a, b - a, b] for a, b in zip(cuts, cuts[1:], strict=False)])
    assert torch.equal(run(batch, rows, window), whole)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(run(batch, rows[2:5], window)[2048:2300], whole[2048:2300])
    finally:
        torch.set_num_threads(before)
