"""Sliding-window attention and logit soft-capping in every attention backend, against the naive
float32 reference of ``helpers.attention_cases``.

Blocks wholly before a request's window are pointed at a NaN block (as the sliding-window KV cache
manager leaves them after releasing them): a backend that reads them produces NaN.
"""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers.attention_cases import (  # noqa: E402
    MIXED,
    Batch,
    assert_close,
    prefill_chunks,
    reference_attention,
    release_blocks_before_window,
)
from pagedllm.attention.cpu_backend import CPUAttentionBackend  # noqa: E402
from pagedllm.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from pagedllm.kernels.cpu.attention import paged_decode_attention, paged_prefill_attention  # noqa: E402
from pagedllm.kernels.cpu.library import kernels_available  # noqa: E402

# Windows shorter than a block, block sized, spanning a few blocks, and longer than every context.
WINDOWS = [1, 5, 16, 23, 1000]


def make_batch(
    requests: list[tuple[int, int]],
    window: int | None,
    *,
    block_size: int = 8,
    group: int = 2,
    head_dim: int = 32,
    query_scale: float = 1.0,
    seed: int = 0,
) -> Batch:
    batch = Batch(
        requests,
        block_size=block_size,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        dtype=torch.float32,
        seed=seed,
    )
    batch.query *= query_scale
    if window is not None:
        release_blocks_before_window(batch, window)
    return batch


def run_backend(backend: object, batch: Batch, window: int | None, soft_cap: float | None) -> torch.Tensor:
    return backend.forward(  # type: ignore[attr-defined]
        batch.query,
        batch.k_cache,
        batch.v_cache,
        batch.meta,
        batch.scale,
        sliding_window=window,
        logits_soft_cap=soft_cap,
    )


def test_reference_window_and_cap_change_the_result() -> None:
    # The cases below would prove nothing if windows and caps did not matter on these inputs.
    batch = make_batch(MIXED, None, query_scale=4.0)
    full = reference_attention(batch)
    assert not torch.allclose(reference_attention(batch, sliding_window=5), full, atol=1e-3)
    assert not torch.allclose(reference_attention(batch, soft_cap=2.0), full, atol=1e-3)
    # A window at least as long as every context is full attention.
    torch.testing.assert_close(reference_attention(batch, sliding_window=1000), full)


@pytest.mark.parametrize("window", [None, *WINDOWS])
@pytest.mark.parametrize("soft_cap", [None, 2.0])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("group", [1, 4])
def test_torch_backend(window: int | None, soft_cap: float | None, block_size: int, group: int) -> None:
    if window is None and soft_cap is None:
        pytest.skip("the plain path (tests/kernels/test_cpu_kernels.py) reads padded NaN slots")
    batch = make_batch(MIXED, window, block_size=block_size, group=group, query_scale=4.0)
    out = run_backend(TorchAttentionBackend(), batch, window, soft_cap)
    assert_close(out, reference_attention(batch, window, soft_cap), torch.float32)


def test_torch_backend_layers_with_different_windows_share_a_batch() -> None:
    # Gemma-style alternation: one backend, one metadata object, full and sliding layers in turn.
    batch = make_batch(MIXED, None, query_scale=4.0)
    batch.k_cache.nan_to_num_(0.0)  # the plain path reads padded slots
    batch.v_cache.nan_to_num_(0.0)
    backend = TorchAttentionBackend()
    for window in (None, 6, None, 6, 11):
        out = run_backend(backend, batch, window, None)
        assert_close(out, reference_attention(batch, window), torch.float32)


# --- native CPU kernels -------------------------------------------------------------------------

needs_kernels = pytest.mark.skipif(not kernels_available(), reason="no C compiler for the CPU kernels")

# Decodes on, just past and inside block boundaries; prompt chunks longer than a kernel task's 64
# query tokens, with and without cached context.
CPU_CASES = [*MIXED, (1, 131), (1, 70), (100, 150), (70, 70)]


@needs_kernels
@pytest.mark.parametrize("window", [None, *WINDOWS])
@pytest.mark.parametrize("soft_cap", [None, 2.0])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_cpu_backend(window: int | None, soft_cap: float | None, block_size: int, head_dim: int) -> None:
    if window is None and soft_cap is None:
        pytest.skip("the plain kernels are tested in tests/kernels/test_cpu_kernels.py")
    batch = make_batch(CPU_CASES, window, block_size=block_size, group=3, head_dim=head_dim, query_scale=4.0)
    out = run_backend(CPUAttentionBackend(), batch, window, soft_cap)
    assert_close(out, reference_attention(batch, window, soft_cap), torch.float32)


@needs_kernels
@pytest.mark.parametrize("window", [3, 17, 40])
def test_cpu_decode_kernel_window(window: int) -> None:
    lengths = [1, 8, 9, 39, 40, 41, 97]
    batch = make_batch([(1, n) for n in lengths], window, block_size=8, group=4, head_dim=64)
    out = paged_decode_attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.meta.seq_lens,
        max(lengths),
        batch.scale,
        sliding_window=window,
    )
    assert_close(out, reference_attention(batch, window), torch.float32)


@needs_kernels
def test_cpu_prefill_kernel_window_and_cap() -> None:
    batch = make_batch(
        [(100, 150), (9, 9), (33, 60)], 21, block_size=16, group=2, head_dim=48, query_scale=4.0
    )
    out = torch.full(batch.query.shape, float("nan"))
    chunks = prefill_chunks(batch)
    paged_prefill_attention(
        batch.query,
        out,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        chunks,
        batch.scale,
        sliding_window=21,
        soft_cap=3.0,
    )
    assert_close(out, reference_attention(batch, 21, 3.0), torch.float32)


@needs_kernels
def test_cpu_kernels_reject_bad_window_and_cap() -> None:
    batch = make_batch([(1, 5)], None)
    args = (
        batch.query,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.meta.seq_lens,
        5,
        batch.scale,
    )
    with pytest.raises(ValueError, match="sliding_window"):
        paged_decode_attention(*args, sliding_window=0)
    with pytest.raises(ValueError, match="soft cap"):
        paged_decode_attention(*args, soft_cap=-1.0)


# --- Triton (the interpreter on CPU) -------------------------------------------------------------


needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)


@needs_triton
@pytest.mark.parametrize("window", [None, 1, 5, 23])
@pytest.mark.parametrize("soft_cap", [None, 2.0])
def test_triton_backend(window: int | None, soft_cap: float | None) -> None:
    if window is None and soft_cap is None:
        pytest.skip("the plain kernel is tested in tests/kernels/test_triton_kernels.py")
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    batch = make_batch(CPU_CASES, window, block_size=16, group=3, query_scale=4.0)
    out = run_backend(TritonAttentionBackend(), batch, window, soft_cap)
    assert_close(out, reference_attention(batch, window, soft_cap), torch.float32)


@needs_triton
@pytest.mark.parametrize(
    "block_m, tile_n, num_splits",
    [(16, 16, 1), (32, 64, 2), (16, 16, 8)],
    ids=["tile16", "tile64-split2", "tile16-split8"],
)
def test_triton_window_tilings(block_m: int, tile_n: int, num_splits: int) -> None:
    # Tiles smaller and larger than a block, split-K with splits that fall wholly before a window.
    from pagedllm.kernels.triton import attention as triton_attention

    requests = [(1, 300), (1, 129), (1, 5), (40, 90), (17, 17)]
    batch = make_batch(requests, 20, block_size=8, group=4, query_scale=4.0, seed=3)
    config = triton_attention.AttentionLaunchConfig(block_m=block_m, tile_n=tile_n, num_splits=num_splits)
    out = triton_attention.paged_attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        batch.meta,
        batch.scale,
        config=config,
        sliding_window=20,
        soft_cap=3.0,
    )
    assert_close(out, reference_attention(batch, 20, 3.0), torch.float32)


_COMPILE_WINDOWED = """
import itertools, json, sys
import torch
from pagedllm.attention.base import AttentionMetadata
from pagedllm.attention.triton_backend import TritonAttentionBackend
from pagedllm.kernels.triton import aot

META = torch.device("meta")


def meta_batch(qlens, slens, bs=16):
    return AttentionMetadata(
        slot_mapping=torch.empty(sum(qlens), dtype=torch.int64, device=META),
        query_start_loc=torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32, device=META),
        seq_lens=torch.empty(len(slens), dtype=torch.int32, device=META),
        block_tables=torch.empty(len(slens), max(slens) // bs + 1, dtype=torch.int32, device=META),
        max_query_len=max(qlens), max_seq_len=max(slens), query_lens_cpu=qlens, seq_lens_cpu=slens,
    )


with aot.compile_for(aot.H200) as launches:
    for dtype in (torch.bfloat16, torch.float32):
        cache = torch.empty(64, 16, 8, 128, dtype=dtype, device=META)
        for qlens, slens in (([1024, 40, 1, 1], [1024, 240, 50, 700]), ([1] * 8, [4096] * 8)):
            q = torch.empty(sum(qlens), 32, 128, dtype=dtype, device=META)
            backend = TritonAttentionBackend()
            backend.forward(q, cache, cache, meta_batch(qlens, slens), 0.1, sliding_window=4096, logits_soft_cap=50.0)
json.dump(
    [{"kernel": l.kernel, "constants": {k: v for k, v in l.constants.items() if isinstance(v, (int, bool))},
      "shared": l.shared_bytes} for l in launches],
    sys.stdout,
)
"""


@pytest.mark.slow
@needs_triton
def test_triton_window_and_cap_compile_for_h200() -> None:
    """The window and soft-cap variants compile for sm_90 without a GPU (in a fresh interpreter:
    compiling needs triton imported without TRITON_INTERPRET)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_WINDOWED],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    launches = json.loads(proc.stdout)
    attention = [v for v in launches if v["kernel"] == "_paged_attention_kernel"]
    assert len(attention) == 4  # prefill and split-K decode tilings, bf16 and fp32
    for v in attention:
        assert v["constants"]["SLIDING_WINDOW"] == 4096 and v["constants"]["USE_SOFT_CAP"] is True
        assert 0 < v["shared"] <= 227 * 1024
