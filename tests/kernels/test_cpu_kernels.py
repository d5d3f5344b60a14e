"""The native CPU kernels (paged decode attention, RMSNorm, SiLU-and-mul, rotary), the CPU attention
backend, the torch backend's length-grouped decodes and the panel-weight linear layers, against naive
references."""

from __future__ import annotations

import ctypes
import random
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.attention_cases import MIXED, Batch, assert_close, reference_attention
from pagedllm.attention.cpu_backend import CPUAttentionBackend
from pagedllm.attention.selector import choose_attention_backend
from pagedllm.attention.torch_backend import TorchAttentionBackend, group_by_length
from pagedllm.kernels.cpu import library
from pagedllm.kernels.cpu import ops as cpu_ops
from pagedllm.kernels.cpu.attention import paged_decode_attention, paged_prefill_attention
from pagedllm.kernels.cpu.library import kernels_available, load_library
from pagedllm.kernels.cpu.linear import PanelEmbedding, PanelLinear, optimize_cpu_linears
from pagedllm.kernels.triton.elementwise import rms_norm_torch, silu_and_mul_torch
from pagedllm.model.layers import RotaryEmbedding
from pagedllm.worker import cpu_memory

needs_kernels = pytest.mark.skipif(not kernels_available(), reason="no C compiler for the CPU kernels")


def decode_batch(lengths: list[int], **kwargs: int) -> Batch:
    return Batch([(1, n) for n in lengths], dtype=torch.float32, **kwargs)


@needs_kernels
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_decode_kernel_matches_reference(block_size: int, group: int, head_dim: int) -> None:
    # Lengths on, just past and inside block boundaries; unused cache slots hold NaN.
    lengths = [1, block_size, block_size + 1, 3 * block_size - 1, 70, 131]
    batch = decode_batch(lengths, block_size=block_size, num_kv_heads=2, group=group, head_dim=head_dim)
    out = paged_decode_attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.meta.seq_lens,
        max(lengths),
        batch.scale,
    )
    assert_close(out, reference_attention(batch), torch.float32)


@needs_kernels
def test_decode_kernel_strided_query_and_output() -> None:
    batch = decode_batch([5, 40, 17], block_size=16, num_kv_heads=3, group=3, head_dim=64, seed=4)
    # The query as a slice of a wider fused projection (row stride larger than heads * head_dim).
    wide = torch.randn(3, batch.num_heads + 6, 64)
    wide[:, : batch.num_heads] = batch.query
    out = torch.full((3, batch.num_heads, 64), float("nan"))
    paged_decode_attention(
        wide[:, : batch.num_heads],
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.meta.seq_lens,
        40,
        batch.scale,
        out=out,
    )
    assert_close(out, reference_attention(batch), torch.float32)


@needs_kernels
def test_decode_kernel_rejects_bad_inputs() -> None:
    batch = decode_batch([5], block_size=16, num_kv_heads=1, group=2, head_dim=32)
    args = (batch.k_cache, batch.v_cache, batch.block_tables, batch.meta.seq_lens, 5, batch.scale)
    with pytest.raises(ValueError, match="query"):
        paged_decode_attention(batch.query.bfloat16(), *args)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(
            batch.query, batch.k_cache, batch.v_cache, batch.block_tables.long(), *args[3:]
        )


@needs_kernels
@pytest.mark.parametrize("group", [1, 3])
def test_cpu_backend_mixed_batch(group: int) -> None:
    """Decodes interleaved with prefill chunks (cached prefixes, fresh prompts), padding rows at the end."""
    batch = Batch(
        MIXED, block_size=16, num_kv_heads=2, group=group, head_dim=32, dtype=torch.float32, padding_tokens=3
    )
    out = CPUAttentionBackend().forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    n = sum(q for q, _ in MIXED)
    assert_close(out[:n], reference_attention(batch)[:n], torch.float32)


# Prompt chunks for the native prefill kernel: longer than its 64-token query blocks, cached context
# that ends mid-block, two-token chunks, a whole prompt, decodes between them.
PREFILL_CHUNKS = [(150, 150), (2, 35), (1, 60), (70, 200), (13, 13), (65, 66)]


@needs_kernels
@pytest.mark.parametrize(
    ("block_size", "group", "head_dim"), [(16, 3, 64), (8, 1, 16), (32, 4, 128), (16, 2, 48), (16, 3, 24)]
)
def test_cpu_backend_prefill_chunks(block_size: int, group: int, head_dim: int) -> None:
    """The native prefill kernel (head_dim a multiple of 16; 24 takes the torch path) against the reference."""
    batch = Batch(
        PREFILL_CHUNKS,
        block_size=block_size,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        dtype=torch.float32,
    )
    out = CPUAttentionBackend().forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(out, reference_attention(batch), torch.float32)


@needs_kernels
def test_prefill_kernel_rejects_bad_inputs() -> None:
    batch = Batch([(5, 5)], block_size=16, num_kv_heads=1, group=2, head_dim=16, dtype=torch.float32)
    q, out = batch.query, torch.empty_like(batch.query)
    chunks = torch.tensor([[0, 0, 5, 5]])
    args = (batch.k_cache, batch.v_cache, batch.meta.block_tables)
    with pytest.raises(ValueError, match="chunks"):
        paged_prefill_attention(q, out, *args, chunks.to(torch.int32), 0.25)
    with pytest.raises(ValueError, match="float32"):
        paged_prefill_attention(q.double(), out, *args, chunks, 0.25)
    with pytest.raises(ValueError, match="multiple of 16"):
        paged_prefill_attention(q[..., :8], out[..., :8], *args, chunks, 0.25)
    paged_prefill_attention(q, out, *args, chunks, 0.25)
    assert_close(out, reference_attention(batch), torch.float32)


@needs_kernels
def test_cpu_backend_all_decodes_in_order() -> None:
    batch = decode_batch([3, 100, 33, 64, 1], block_size=16, num_kv_heads=3, group=3, head_dim=64, seed=5)
    out = CPUAttentionBackend().forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(out, reference_attention(batch), torch.float32)


def test_torch_backend_grouped_decodes() -> None:
    """Very different lengths split the decodes into several padded groups."""
    lengths = [2, 3, 700, 5, 650, 64, 1, 690]
    assert len(group_by_length(lengths)) > 1
    batch = decode_batch(lengths, block_size=16, num_kv_heads=2, group=2, head_dim=32, seed=6)
    # The reference backend reads padding slots and masks them, so they must hold finite values
    # (large ones here, so that a masking mistake shows).
    batch.k_cache = batch.k_cache.nan_to_num(nan=1e4)
    batch.v_cache = batch.v_cache.nan_to_num(nan=1e4)
    out = TorchAttentionBackend().forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_close(out, reference_attention(batch), torch.float32)


def _cost(lengths: list[int], groups: list[list[int]], group_cost: int) -> int:
    return sum(len(g) * max(lengths[i] for i in g) + group_cost for g in groups)


def _best_cost(lengths: list[int], group_cost: int) -> int:
    """Brute force over every contiguous split of the sorted lengths."""
    s = sorted(lengths)
    n = len(s)
    best = None
    for mask in range(1 << (n - 1)):
        cost, start = 0, 0
        for i in range(n):
            if i == n - 1 or mask >> i & 1:
                cost += (i + 1 - start) * s[i] + group_cost
                start = i + 1
        best = cost if best is None else min(best, cost)
    assert best is not None
    return best


@pytest.mark.parametrize("seed", range(20))
def test_group_by_length_is_an_optimal_partition(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 2000) for _ in range(rng.randint(1, 9))]
    group_cost = rng.choice([0, 100, 1024, 100_000])
    groups = group_by_length(lengths, group_cost)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert _cost(lengths, groups, group_cost) == _best_cost(lengths, group_cost)


def test_choose_attention_backend() -> None:
    cpu = torch.device("cpu")
    assert choose_attention_backend("torch", cpu, torch.float32) == "torch"
    expected = "cpu" if kernels_available() else "torch"
    assert choose_attention_backend(None, cpu, torch.float32) == expected
    assert choose_attention_backend(None, cpu, torch.bfloat16) == "torch"
    with pytest.raises(ValueError, match="attention_backend 'cpu'"):
        choose_attention_backend("cpu", cpu, torch.bfloat16)


@needs_kernels
@pytest.mark.parametrize("rows", [0, 1, 3, 4, 12, 13, 17, 32, 65, 300, 400, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_matches_f_linear(rows: int, bias: bool) -> None:
    # 200 outputs: six full panels and a last one of 8 columns; 400 and 1000 rows cross row-block
    # boundaries (384 rows a pass).
    torch.manual_seed(rows)
    linear = nn.Linear(97, 200, bias=bias)
    weight = linear.weight.detach().clone()
    panel = PanelLinear(linear)
    x = torch.randn(rows, 97)
    torch.testing.assert_close(panel(x), F.linear(x, weight, linear.bias), atol=1e-5, rtol=1e-5)
    # Non-contiguous and 3-D inputs.
    x3 = torch.randn(2, rows, 194)[:, :, ::2]
    torch.testing.assert_close(panel(x3), F.linear(x3, weight, linear.bias), atol=1e-5, rtol=1e-5)
    # The original weight is gone; its rows are still readable from the panels.
    assert not hasattr(panel, "weight")
    ids = torch.tensor([0, 31, 32, 199])
    assert torch.equal(panel.weight_rows(ids), weight[ids])


@needs_kernels
def test_panel_linear_row_does_not_depend_on_batch() -> None:
    torch.manual_seed(0)
    panel = PanelLinear(nn.Linear(576, 960))
    x = torch.randn(45, 576)
    together = panel(x)
    for rows in (range(1), range(7, 20), range(44, 45)):
        assert torch.equal(panel(x[rows.start : rows.stop]), together[rows.start : rows.stop])
    with pytest.raises(TypeError, match="float32"):
        panel(x.double())


def test_optimize_cpu_linears_keeps_tied_weights_shared() -> None:
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.proj = nn.Linear(16, 16)
            self.head = nn.Linear(16, 50, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.proj(self.embed(ids)))

    model = Tiny()
    ids = torch.arange(50).repeat(2)
    expected = model(ids)
    form = optimize_cpu_linears(model)
    assert form == ("panels" if kernels_available() else "column-major")
    if kernels_available():
        # One copy: the head holds panels only and the embedding reads its rows from them.
        assert isinstance(model.head, PanelLinear) and isinstance(model.embed, PanelEmbedding)
        assert model.embed.head is model.head
        assert not any(isinstance(m, nn.Linear) for m in model.modules())
        assert sum(p.numel() for p in model.parameters()) == 16 + 50 * 0  # the projection's bias only
        with pytest.raises(IndexError, match="token ids"):
            model.embed(torch.tensor([50]))
    else:
        assert model.head.weight is model.embed.weight
    torch.testing.assert_close(model(ids), expected, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("with_residual", [False, True])
def test_native_rms_norm_matches_torch(rows: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 700, generator=gen)
    x = wide[:, 50:626]  # rows strided wider than the hidden size
    residual = torch.randn(rows, 576, generator=gen) if with_residual else None
    weight = torch.randn(576, generator=gen)
    out, summed = cpu_ops.rms_norm(x, weight, 1e-5, residual)
    expected_sum = x + residual if residual is not None else x
    torch.testing.assert_close(out, rms_norm_torch(expected_sum, weight, 1e-5), atol=1e-5, rtol=1e-5)
    if residual is None:
        assert summed is None
    else:
        assert summed is not None and torch.equal(summed, expected_sum)
    # 3-D input (per-head norms of Qwen3).
    x3 = torch.randn(rows, 4, 64, generator=gen)
    out3, _ = cpu_ops.rms_norm(x3, weight[:64], 1e-6)
    torch.testing.assert_close(out3, rms_norm_torch(x3, weight[:64], 1e-6), atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 33])
def test_native_silu_and_mul_matches_torch(rows: int) -> None:
    x = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 4
    torch.testing.assert_close(cpu_ops.silu_and_mul(x), silu_and_mul_torch(x), atol=1e-5, rtol=1e-5)


@needs_kernels
def test_native_rotary_matches_torch_in_place() -> None:
    gen = torch.Generator().manual_seed(3)
    rotary = RotaryEmbedding(64, 4096, 10000.0)
    positions = torch.tensor([0, 1, 17, 4095, 300])
    qkv = torch.randn(5, (9 + 2 * 3) * 64, generator=gen)
    qk = qkv[:, : 12 * 64].view(5, 12, 64)  # q and k heads of a fused projection, strided rows
    tables = rotary.tables(positions)
    assert tables.full is None, "the native path needs no per-token tables"
    # HF's x * cos + rotate_half(x) * sin.
    cos = torch.cat([rotary.cos_cache[positions]] * 2, -1)[:, None]
    sin = torch.cat([rotary.sin_cache[positions]] * 2, -1)[:, None]
    rotate_half = torch.cat([-qk[..., 32:], qk[..., :32]], -1)
    reference = qk * cos + rotate_half * sin
    v_before = qkv[:, 12 * 64 :].clone()
    out = tables.apply(qk)
    assert out.data_ptr() == qk.data_ptr(), "rotated in place"
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, 12 * 64 :], v_before), "V untouched"


def _interleave_rows(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's GGUF order of each head's dimensions: HF's (half, i) becomes (i, half)."""
    *lead, d = x.shape
    return x.reshape(*lead, 2, d // 2).transpose(-1, -2).reshape(*lead, d)


@needs_kernels
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_interleaved_rotary_is_hf_rotary_in_the_gguf_order(native: bool) -> None:
    """Rotating the pairs (2i, 2i + 1) of dimensions in llama.cpp's order equals HF's rotate-half
    rotation of the same values in HF's order, reordered; so q . k (both reordered) is unchanged."""
    gen = torch.Generator().manual_seed(5)
    hf = RotaryEmbedding(64, 4096, 10000.0)
    gguf = RotaryEmbedding(64, 4096, 10000.0, interleaved=True)
    positions = torch.tensor([0, 3, 17, 4095, 300])
    q, k = torch.randn(5, 9, 64, generator=gen), torch.randn(5, 3, 64, generator=gen)
    want_q, want_k = hf.tables(positions).apply(q.clone()), hf.tables(positions).apply(k.clone())
    tables = gguf.tables(positions)
    if not native:
        tables.full = tables.full_rows()  # the torch path (as on a GPU)
    got_q = tables.apply(_interleave_rows(q).contiguous())
    got_k = tables.apply(_interleave_rows(k).contiguous())
    torch.testing.assert_close(got_q, _interleave_rows(want_q), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, _interleave_rows(want_k), atol=1e-5, rtol=1e-5)
    scores = torch.einsum("thd,tgd->thg", got_q, got_k)
    torch.testing.assert_close(scores, torch.einsum("thd,tgd->thg", want_q, want_k), atol=1e-4, rtol=1e-4)


@needs_kernels
def test_native_max_logsumexp_matches_torch() -> None:
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(6, 49152, generator=gen) * 8
    x[1, ::3] = float("-inf")  # masked tokens
    x[2] = float("-inf")  # a row with nothing left
    x[3, [10, 20]] = 1e4  # a tie: the first index wins
    best, index, lse = cpu_ops.max_logsumexp(x[:, :49000])  # strided rows
    ref_best, ref_index = x[:, :49000].max(dim=-1)
    assert torch.equal(best, ref_best)
    assert index.tolist()[3] == 10
    assert torch.equal(index[[0, 1, 4, 5]], ref_index[[0, 1, 4, 5]])
    torch.testing.assert_close(lse, torch.logsumexp(x[:, :49000], dim=-1), atol=1e-4, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 33, 100, 257])
def test_native_softmax_row_matches_torch(n: int) -> None:
    # The attention kernels' softmax (its own vector exp, a masked last vector): accurate, and nothing
    # past the row is touched.
    gen = torch.Generator().manual_seed(n)
    for scale in (1.0, 10.0, 100.0):
        row = torch.randn(n, generator=gen) * scale
        buf = torch.cat([row, torch.full((17,), 7.0)])
        load_library().softmax_row_f32(buf.data_ptr(), n)
        expected = torch.softmax(row.double(), dim=0).float()
        # Scores far below the maximum carry float32's rounding of the difference (torch's float32
        # softmax is off by as much there).
        torch.testing.assert_close(buf[:n], expected, rtol=1e-6 if scale == 1.0 else 1e-5, atol=1e-30)
        assert torch.equal(buf[n:], torch.full((17,), 7.0))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc and madvise are Linux's")
def test_cpu_memory_settings() -> None:
    assert cpu_memory.keep_freed_memory()
    assert cpu_memory.keep_freed_memory()  # once per process; repeating is harmless
    big = torch.empty(8 << 20)  # 32 MiB: spans whole 2 MiB pages
    assert cpu_memory.advise_huge_pages(big)
    big.zero_()
    small = torch.empty(16)  # no whole huge page inside
    assert not cpu_memory.advise_huge_pages(small)
    assert not cpu_memory.advise_huge_pages(torch.empty(8 << 20, device="meta"))


def _anon_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("RssAnon"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc is Linux's")
def test_freed_memory_is_kept_then_given_back_when_idle() -> None:
    """Freed activations stay with the process (reused without page faults) until the engine goes
    idle and trims them."""
    assert cpu_memory.keep_freed_memory()
    chunks = [torch.ones(16 << 20) for _ in range(8)]  # 8 x 64 MiB from the heap, touched
    held = _anon_mib()
    del chunks
    kept = _anon_mib()
    assert kept > held - 128, (held, kept)  # most of the 512 MiB is still resident
    assert cpu_memory.trim_freed_memory()
    assert _anon_mib() < kept - 384, (kept, _anon_mib())


@pytest.mark.parametrize("vocab", [49152, 1000, 33])
def test_token_bitmask_matches_xgrammar(vocab: int) -> None:
    import xgrammar as xgr

    from pagedllm.kernels.cpu.ops import apply_token_bitmask

    gen = torch.Generator().manual_seed(vocab)
    rows = 6
    logits = torch.randn(rows, vocab, generator=gen)
    bitmask = xgr.allocate_token_bitmask(rows, vocab)
    bitmask.copy_(
        torch.randint(-(2**31), 2**31 - 1, bitmask.shape, generator=gen, dtype=torch.int64).to(torch.int32)
    )
    bitmask[1] = 0  # nothing allowed
    bitmask[2] = -1  # everything allowed
    bitmask[3, ::2] = 0  # sparse words, as a grammar's mask mostly is
    chosen = [0, 1, 2, 3, 5]  # row 4 is left alone
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab, indices=chosen)
    got = logits.clone()
    apply_token_bitmask(got, bitmask, chosen)
    assert torch.equal(got, expected)
    assert torch.equal(got[4], logits[4]) and torch.equal(got[2], logits[2])
    assert torch.isinf(got[1]).all()


@needs_kernels
def test_concurrent_builds_compile_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Processes (here threads) that need the same missing library build it once: the others wait
    for the builder's lock and then load its file."""
    source = tmp_path / "one.c"
    source.write_text("int one(void) { return 1; }\n")
    monkeypatch.setattr(library, "_SOURCES", [source])
    commands: list[list[str]] = []
    real_run = library._run

    def slow_run(cmd: list[str]) -> None:
        commands.append(cmd)
        time.sleep(0.2)  # long enough for every thread to reach the lock while the first builds
        real_run(cmd)

    monkeypatch.setattr(library, "_run", slow_run)
    target = tmp_path / "kernels" / "lib.so"
    cc = library._compiler()
    threads = [threading.Thread(target=library._build, args=(cc, target)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert len(commands) == 2, commands  # one compile and one link, by one of the three
    assert ctypes.CDLL(str(target)).one() == 1
    assert sorted(p.name for p in target.parent.iterdir()) == ["lib.lock", "lib.so"]  # no leftovers
