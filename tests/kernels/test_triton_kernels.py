"""Triton attention kernels against a naive reference, on CPU under the Triton interpreter."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from helpers.attention_cases import MIXED, Batch, assert_close, reference_attention  # noqa: E402
from pagedllm.attention.base import AttentionMetadata  # noqa: E402
from pagedllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagedllm.kernels.triton.attention import AttentionLaunchConfig, paged_attention  # noqa: E402
from pagedllm.kernels.triton.kv_write import write_kv  # noqa: E402


@pytest.fixture(autouse=True)
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------------
# write_kv
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16])
def test_write_kv_matches_index_copy(dtype: torch.dtype, block_size: int) -> None:
    gen = torch.Generator().manual_seed(1)
    num_blocks, num_kv_heads, head_dim, num_tokens = 6, 3, 32, 21
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[3, 10, 20]] = -1  # padding tokens
    # key/value as strided views of a fused qkv projection output, in float32 (cast on store).
    qkv = torch.randn(num_tokens, 4 * num_kv_heads * head_dim, generator=gen)
    key = qkv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 2 * num_kv_heads * head_dim : 3 * num_kv_heads * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    expected_k.view(-1, num_kv_heads, head_dim).index_copy_(0, slots[keep], key[keep].to(dtype))
    expected_v.view(-1, num_kv_heads, head_dim).index_copy_(0, slots[keep], value[keep].to(dtype))

    write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


def test_write_kv_into_cache_views() -> None:
    """Caches may be slices of one larger allocation (e.g. per-layer views of a [2, ...] tensor)."""
    gen = torch.Generator().manual_seed(2)
    kv = torch.zeros(2, 4, 16, 2, 64)
    k_cache, v_cache = kv[0], kv[1]
    key = torch.randn(5, 2, 64, generator=gen)
    value = torch.randn(5, 2, 64, generator=gen)
    slots = torch.tensor([0, 17, 63, 40, 1])
    write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 2, 64)[slots], key)
    assert torch.equal(v_cache.view(-1, 2, 64)[slots], value)


# --------------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_mixed_batch_fp32(block_size: int, group: int) -> None:
    batch = Batch(MIXED, block_size=block_size, num_kv_heads=2, group=group, head_dim=32, dtype=torch.float32)
    out = TritonAttentionBackend().forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(out, reference_attention(batch), torch.float32)


@pytest.mark.parametrize(
    "config",
    [
        AttentionLaunchConfig(block_m=16, tile_n=16, num_splits=1),  # tiles smaller than a block
        AttentionLaunchConfig(block_m=32, tile_n=32, num_splits=2),  # tiles spanning blocks, split-K
        AttentionLaunchConfig(block_m=16, tile_n=16, num_splits=8),  # more splits than some tiles
    ],
    ids=["tile16", "tile32-split2", "tile16-split8"],
)
def test_mixed_batch_tilings(config: AttentionLaunchConfig) -> None:
    batch = Batch(MIXED, block_size=32, num_kv_heads=1, group=4, head_dim=16, dtype=torch.float32, seed=3)
    out = paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale, config=config)
    assert_close(out, reference_attention(batch), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_batch_long_context(num_splits: int) -> None:
    requests = [(1, 300), (1, 129), (1, 5), (1, 64)]
    batch = Batch(requests, block_size=16, num_kv_heads=2, group=4, head_dim=32, dtype=torch.float32, seed=4)
    config = AttentionLaunchConfig(block_m=16, tile_n=64, num_splits=num_splits)
    out = paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale, config=config)
    assert_close(out, reference_attention(batch), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_half_precision(dtype: torch.dtype, head_dim: int) -> None:
    requests = [(1, 50), (12, 30), (1, 17)]
    batch = Batch(requests, block_size=16, num_kv_heads=2, group=3, head_dim=head_dim, dtype=dtype, seed=5)
    out = TritonAttentionBackend().forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert out.dtype == dtype
    assert_close(out, reference_attention(batch), dtype)


def test_bf16_split_decode() -> None:
    batch = Batch(
        [(1, 90), (1, 33)], block_size=8, num_kv_heads=1, group=4, head_dim=64, dtype=torch.bfloat16
    )
    config = AttentionLaunchConfig(block_m=16, tile_n=16, num_splits=4)
    out = paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale, config=config)
    assert_close(out, reference_attention(batch), torch.bfloat16)


@pytest.mark.parametrize("block_size", [1, 2])
def test_tiny_blocks(block_size: int) -> None:
    batch = Batch(
        [(3, 11), (1, 6)], block_size=block_size, num_kv_heads=1, group=2, head_dim=16, dtype=torch.float32
    )
    out = TritonAttentionBackend().forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(out, reference_attention(batch), torch.float32)


def test_padding_rows_and_strided_query() -> None:
    """Rows past the last request come back as zeros; the query may be a strided view."""
    batch = Batch(
        [(4, 20), (1, 9)],
        block_size=16,
        num_kv_heads=2,
        group=2,
        head_dim=32,
        dtype=torch.float32,
        padding_tokens=3,
    )
    num_tokens = batch.query.shape[0]
    fused = torch.zeros(num_tokens, 2 * batch.num_heads * 32)
    query = fused[:, : batch.num_heads * 32].view(num_tokens, batch.num_heads, 32)
    query.copy_(batch.query)
    out = TritonAttentionBackend().forward(query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(out, reference_attention(batch), torch.float32)
    assert torch.equal(out[-3:], torch.zeros_like(out[-3:]))


def test_matches_torch_backend() -> None:
    torch_backend = pytest.importorskip("pagedllm.attention.torch_backend")
    batch = Batch(MIXED, block_size=16, num_kv_heads=2, group=3, head_dim=32, dtype=torch.float32, seed=6)
    k_cache, v_cache = batch.k_cache.nan_to_num(0.0), batch.v_cache.nan_to_num(0.0)
    expected = torch_backend.TorchAttentionBackend().forward(
        batch.query, k_cache, v_cache, batch.meta, batch.scale
    )
    out = TritonAttentionBackend().forward(batch.query, k_cache, v_cache, batch.meta, batch.scale)
    assert_close(out, expected, torch.float32)


def test_chunked_prefill_then_decode_matches_full_attention() -> None:
    """write_kv + forward step by step (two prefill chunks, then decodes) equals one causal pass."""
    gen = torch.Generator().manual_seed(7)
    block_size, num_kv_heads, group, head_dim, total = 8, 2, 2, 32, 29
    num_heads = num_kv_heads * group
    q = torch.randn(total, num_heads, head_dim, generator=gen)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, dim=1)) * head_dim**-0.5
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    expected = torch.einsum("hqk,khd->qhd", probs, v.repeat_interleave(group, dim=1))

    backend = TritonAttentionBackend()
    k_cache = torch.zeros(8, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    blocks = torch.tensor([5, 2, 7, 0], dtype=torch.int32)
    positions = torch.arange(total)
    slots_all = blocks.long()[positions // block_size] * block_size + positions % block_size
    outputs = []
    for lo, hi in [(0, 11), (11, 26), (26, 27), (27, 28), (28, 29)]:
        n = hi - lo
        meta = AttentionMetadata(
            slot_mapping=slots_all[lo:hi],
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([hi], dtype=torch.int32),
            block_tables=blocks[None, :],
            max_query_len=n,
            max_seq_len=hi,
            query_lens_cpu=[n],
            seq_lens_cpu=[hi],
        )
        backend.write_kv(k[lo:hi], v[lo:hi], k_cache, v_cache, meta.slot_mapping)
        outputs.append(backend.forward(q[lo:hi], k_cache, v_cache, meta, head_dim**-0.5))
    assert_close(torch.cat(outputs), expected, torch.float32)


# --------------------------------------------------------------------------------------------------
# Launch modes that need a fresh process: TRITON_INTERPRET is read when triton is imported.
# --------------------------------------------------------------------------------------------------

_ISOLATED_CHECK = textwrap.dedent(
    """
    import sys
    import torch
    sys.path.insert(0, {tests_dir!r})
    from helpers.attention_cases import MIXED, Batch, assert_close, reference_attention
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    device = torch.device({device!r})
    backend = TritonAttentionBackend()
    cases = [(MIXED, 16), ([(1, 700), (1, 33), (1, 260)], 16), ([(40, 300), (1, 64)], 32)][: {num_cases}]
    for dtype in {dtypes}:
        for requests, block_size in cases:
            batch = Batch(requests, block_size=block_size, num_kv_heads=2, group=4, head_dim=64, dtype=dtype)
            meta = batch.meta
            for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
                setattr(meta, name, getattr(meta, name).to(device))
            k_cache, v_cache = batch.k_cache.to(device), batch.v_cache.to(device)
            out = backend.forward(batch.query.to(device), k_cache, v_cache, meta, batch.scale)
            assert_close(out.cpu(), reference_attention(batch), dtype)
    print("ok")
    """
)


def _run_isolated(device: str, dtypes: str, *, interpret: str, num_cases: int) -> None:
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = _ISOLATED_CHECK.format(tests_dir=tests_dir, device=device, dtypes=dtypes, num_cases=num_cases)
    env = {**os.environ, "TRITON_INTERPRET": interpret}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-4000:]


def test_cpu_tensors_without_interpret_env() -> None:
    """With TRITON_INTERPRET unset, CPU launches switch to interpreted copies of the kernels."""
    _run_isolated("cpu", "[torch.bfloat16]", interpret="0", num_cases=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_kernels_on_gpu() -> None:
    _run_isolated("cuda", "[torch.float32, torch.float16, torch.bfloat16]", interpret="0", num_cases=3)


# --------------------------------------------------------------------------------------------------
# Fused elementwise kernels
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_and_activation(dtype: torch.dtype) -> None:
    from pagedllm.kernels.triton import elementwise as lt

    gen = torch.Generator().manual_seed(8)
    x = torch.randn(5, 96, generator=gen).to(dtype)
    residual = torch.randn(5, 96, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}

    out = lt.rms_norm(x, weight, 1e-6, use_triton=True)
    torch.testing.assert_close(out, lt.rms_norm_torch(x, weight, 1e-6), **tol)

    out, new_residual = lt.fused_add_rms_norm(x, residual, weight, 1e-6, use_triton=True)
    expected_out, expected_residual = lt.fused_add_rms_norm(x, residual, weight, 1e-6, use_triton=False)
    # (The interpreter truncates fp32 -> bf16 casts where GPUs round to nearest: allow one bf16 ulp.)
    torch.testing.assert_close(new_residual, expected_residual, **tol)
    torch.testing.assert_close(out, expected_out, **tol)

    gate_up = torch.randn(3, 2, 160, generator=gen).to(dtype)
    out = lt.silu_and_mul(gate_up, use_triton=True)
    assert out.shape == (3, 2, 80)
    torch.testing.assert_close(out, lt.silu_and_mul_torch(gate_up), **tol)
