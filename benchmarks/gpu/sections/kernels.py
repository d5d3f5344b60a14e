"""``kernels``: the Triton kernels against torch references on random shapes.

Paged attention on mixed prefill/decode batches, long decodes and CUDA-graph-style padded decode
batches with a fixed split-K (the batches, their float32 reference and the tolerances are the test
suite's, ``tests/helpers/attention_cases.py``; unused cache slots hold NaN, so reading one fails the
case), KV writes, RMSNorm, fused add + RMSNorm, SiLU-and-mul, and the top-k / top-p thresholds the
sampling kernel settles on the device.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from helpers.attention_cases import MIXED, TOLERANCES, Batch, reference_attention
from pagedllm.attention.base import AttentionMetadata

from .common import Settings
from .probes import sync_warnings


def compare(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
    """Elementwise ``|actual - expected| <= atol + rtol * |expected|`` at the test suite's tolerances
    for ``dtype``; any NaN or inf fails."""
    atol, rtol = TOLERANCES[dtype]["atol"], TOLERANCES[dtype]["rtol"]
    a = actual.float().cpu()
    e = expected.float().cpu()
    finite = bool(torch.isfinite(a).all())
    err = (a - e).abs()
    ok = finite and a.shape == e.shape and bool((err <= atol + rtol * e.abs()).all())
    return {
        "ok": ok,
        "finite": finite,
        "max_abs_err": float(err.max()) if finite and err.numel() else math.nan,
        "atol": atol,
        "rtol": rtol,
    }


def add_padding_rows(batch: Batch, rows: int, seed: int) -> None:
    """Append ``rows`` decode rows in the CUDA-graph padding layout to a batch built with
    ``padding_tokens=rows``: one query token each, no slot, a context of one position in block 0
    (block table row of zeros), which is given finite values when no request holds it."""
    if bool(torch.isnan(batch.k_cache[0, 0].float()).any()):
        gen = torch.Generator().manual_seed(seed)
        batch.k_cache[0] = torch.randn(batch.k_cache.shape[1:], generator=gen).to(batch.k_cache.dtype)
        batch.v_cache[0] = torch.randn(batch.v_cache.shape[1:], generator=gen).to(batch.v_cache.dtype)
    meta = batch.meta
    starts = meta.query_start_loc.tolist()
    starts += [starts[-1] + i for i in range(1, rows + 1)]
    tables = meta.block_tables
    batch.meta = dataclasses.replace(
        meta,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(meta.seq_lens_cpu + [1] * rows, dtype=torch.int32),
        block_tables=torch.cat([tables, torch.zeros(rows, tables.shape[1], dtype=torch.int32)]),
        query_lens_cpu=meta.query_lens_cpu + [1] * rows,
        seq_lens_cpu=meta.seq_lens_cpu + [1] * rows,
    )


def on_device(
    batch: Batch, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The batch's query, K and V caches and metadata on ``device`` (the batch stays on the CPU for
    its reference)."""
    meta = batch.meta
    moved = {
        name: getattr(meta, name).to(device)
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")
    }
    return (
        batch.query.to(device),
        batch.k_cache.to(device),
        batch.v_cache.to(device),
        dataclasses.replace(meta, **moved),
    )


@dataclass
class AttentionCase:
    name: str
    requests: list[tuple[int, int]]
    block_size: int
    num_kv_heads: int
    group: int
    head_dim: int
    dtype: torch.dtype
    num_splits: int | None = None
    padding_rows: int = 0


def attention_cases(scale: str) -> list[AttentionCase]:
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    if scale == "tiny":
        return [
            AttentionCase("mixed-fp32-d32-g2", MIXED, 16, 2, 2, 32, f32),
            AttentionCase("decode-bf16-split4-padded", [(1, 50), (1, 3), (1, 33)], 16, 2, 2, 32, bf16, 4, 1),
        ]
    rng = random.Random(1234)
    random_mixed = [(rng.choice([1, 1, 1, rng.randint(2, 300)]), 0) for _ in range(24)]
    random_mixed = [(q, q + rng.randint(0, 1500)) for q, _ in random_mixed]
    long_decode = [(1, rng.randint(1, 4000)) for _ in range(32)]
    return [
        AttentionCase("mixed-bf16-d128-g2 (Qwen3)", MIXED, 16, 8, 2, 128, bf16),
        AttentionCase("mixed-bf16-d64-g3 (SmolLM2)", MIXED, 16, 3, 3, 64, bf16),
        AttentionCase("random-mixed-bf16-d128-g2", random_mixed, 16, 8, 2, 128, bf16),
        AttentionCase("long-decode-bf16-d128-auto", long_decode, 16, 8, 2, 128, bf16),
        AttentionCase("graph-decode-bf16-split8-padded", long_decode[:13], 16, 8, 2, 128, bf16, 8, 3),
        AttentionCase("graph-decode-bf16-split1-padded", long_decode[:5], 16, 8, 2, 128, bf16, 1, 3),
        AttentionCase("prefix-prefill-bf16-d128", [(700, 1000), (1, 5)], 16, 8, 2, 128, bf16),
        AttentionCase("mixed-fp16-d128-g4-bs32", MIXED, 32, 2, 4, 128, f16),
        AttentionCase("mixed-fp32-d64-g1", MIXED, 16, 4, 1, 64, f32),
    ]


def run_attention_case(case: AttentionCase, device: torch.device, seed: int) -> dict[str, Any]:
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    batch = Batch(
        case.requests,
        block_size=case.block_size,
        num_kv_heads=case.num_kv_heads,
        group=case.group,
        head_dim=case.head_dim,
        dtype=case.dtype,
        seed=seed,
        padding_tokens=case.padding_rows,
    )
    if case.padding_rows:
        add_padding_rows(batch, case.padding_rows, seed)
    query, k_cache, v_cache, meta = on_device(batch, device)
    backend = TritonAttentionBackend(num_splits=case.num_splits)
    config = backend.launch_config(query, k_cache, meta)
    out = backend.forward(query, k_cache, v_cache, meta, batch.scale)
    num_real = sum(q for q, _ in case.requests)
    result = compare(out[:num_real], reference_attention(batch)[:num_real], case.dtype)
    if case.padding_rows:
        # Padding rows attend to block 0: finite, whatever they hold.
        padded_finite = bool(torch.isfinite(out[num_real:].float()).all())
        result["ok"] = result["ok"] and padded_finite
        result["padding_finite"] = padded_finite
    result["config"] = {"block_m": config.block_m, "tile_n": config.tile_n, "num_splits": config.num_splits}
    return result


def run_write_kv_case(device: torch.device, dtype: torch.dtype, seed: int, scale: str) -> dict[str, Any]:
    from pagedllm.kernels.triton.kv_write import write_kv

    gen = torch.Generator().manual_seed(seed)
    num_blocks, block_size, kv_heads, head_dim = (6, 16, 2, 32) if scale == "tiny" else (64, 16, 8, 128)
    num_tokens = 21 if scale == "tiny" else 300
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[:: max(1, num_tokens // 5)] = -1
    qkv = torch.randn(num_tokens, 4 * kv_heads * head_dim, generator=gen).to(dtype)
    key = qkv[:, : kv_heads * head_dim].view(num_tokens, kv_heads, head_dim)
    value = qkv[:, 2 * kv_heads * head_dim : 3 * kv_heads * head_dim].view(num_tokens, kv_heads, head_dim)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    expected_k.view(-1, kv_heads, head_dim).index_copy_(0, slots[keep], key[keep])
    expected_v.view(-1, kv_heads, head_dim).index_copy_(0, slots[keep], value[keep])
    kc, vc = k_cache.to(device), v_cache.to(device)
    write_kv(key.to(device), value.to(device), kc, vc, slots.to(device))
    ok = torch.equal(kc.cpu(), expected_k) and torch.equal(vc.cpu(), expected_v)
    return {"ok": bool(ok), "exact": True}


def run_elementwise_cases(device: torch.device, seed: int, scale: str) -> list[tuple[str, dict[str, Any]]]:
    from pagedllm.kernels.triton import elementwise as lt

    use_triton = True  # the interpreter on CPU tensors, compiled kernels on CUDA ones
    gen = torch.Generator().manual_seed(seed)
    shapes = [(3, 64), (5, 2, 32)] if scale == "tiny" else [(1, 1024), (7, 576), (300, 1024), (33, 16, 128)]
    out: list[tuple[str, dict[str, Any]]] = []
    for dtype in (torch.bfloat16, torch.float16) if scale == "full" else (torch.bfloat16,):
        for shape in shapes:
            tag = f"{str(dtype).removeprefix('torch.')}-{'x'.join(map(str, shape))}"
            x = (torch.randn(shape, generator=gen) * 3).to(dtype)
            res = torch.randn(shape, generator=gen).to(dtype)
            w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
            xd, rd, wd = x.to(device), res.to(device), w.to(device)
            got = lt.rms_norm(xd, wd, 1e-6, use_triton=use_triton)
            out.append((f"rms_norm {tag}", compare(got, lt.rms_norm_torch(x, w, 1e-6), dtype)))
            got, got_res = lt.fused_add_rms_norm(xd, rd, wd, 1e-6, use_triton=use_triton)
            summed = x + res
            result = compare(got, lt.rms_norm_torch(summed, w, 1e-6), dtype)
            # Compiled kernels round the sum as torch does; the interpreter truncates to bf16 instead.
            result["residual_exact"] = bool(torch.equal(got_res.cpu(), summed))
            residual_ok = result["residual_exact"] or (
                device.type != "cuda" and compare(got_res, summed, dtype)["ok"]
            )
            result["ok"] = result["ok"] and residual_ok
            out.append((f"fused_add_rms_norm {tag}", result))
            gate_up = torch.randn(*shape[:-1], 2 * shape[-1] * (3 if scale == "full" else 1), generator=gen)
            gate_up = gate_up.to(dtype)
            got = lt.silu_and_mul(gate_up.to(device), use_triton=use_triton)
            out.append((f"silu_and_mul {tag}", compare(got, lt.silu_and_mul_torch(gate_up), dtype)))
    return out


def run_threshold_case(device: torch.device, seed: int, scale: str) -> dict[str, Any]:
    """Top-k / top-p thresholds settled on the device by the Triton kernel against the CPU's
    candidate-widening search, on rows that mostly reach past the first candidate set (flat rows
    with high top-p, top-k sets wider than the candidates); with the time of the whole filter."""
    from pagedllm.sample import filter_thresholds

    rows, vocab = (6, 3000) if scale == "tiny" else (256, 151936)
    gen = torch.Generator().manual_seed(seed)
    scales = torch.tensor([0.05, 0.5, 1.0, 2.0, 4.0, 8.0]).repeat(rows)[:rows]
    probs = (torch.randn(rows, vocab, generator=gen) * scales[:, None]).softmax(dim=-1)
    top_k = [(0, 0, 1000, 500, 0, 50)[i % 6] for i in range(rows)]
    top_p = [(0.9, 0.95, 0.8, 1.0, 0.5, 0.99)[i % 6] for i in range(rows)]
    expected = filter_thresholds(probs, top_k, top_p, settle_on_device=False)
    on_device = probs.to(device)
    got = filter_thresholds(on_device, top_k, top_p, settle_on_device=True).cpu()
    kept_expected = (probs >= expected[:, None]).sum(dim=-1)
    kept_got = (probs >= got[:, None]).sum(dim=-1)
    result: dict[str, Any] = {
        "ok": bool(torch.isfinite(got).all()) and torch.allclose(got, expected, rtol=1e-5, atol=0.0),
        "rows": rows,
        "vocab": vocab,
        "rows_differing_in_kept_count": int((kept_got != kept_expected).sum()),
        "max_kept_count_difference": int((kept_got - kept_expected).abs().max()),
    }
    if device.type == "cuda":
        for _ in range(2):
            filter_thresholds(on_device, top_k, top_p)
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        for _ in range(10):
            filter_thresholds(on_device, top_k, top_p)
        torch.cuda.synchronize(device)
        result["filter_ms"] = 1e3 * (time.perf_counter() - t) / 10
        try:
            result["sampler_syncs"] = sampler_syncs(on_device.log(), top_k, top_p)
        except Exception as exc:  # noqa: BLE001 - a measurement, not a check: keep the other cases
            result["sampler_syncs"] = {"error": f"{type(exc).__name__}: {exc}"}
    return result


def sampler_syncs(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> dict[str, Any]:
    """Synchronising CUDA calls made while sampling rows with top-k / top-p (and, on some rows,
    min-p, seeds and logprobs): none expected, so sampling can be queued ahead of the device."""
    from pagedllm.sample import Sampler, SamplingInputs, make_generator
    from pagedllm.sampling_params import SamplingParams

    rows = logits.shape[0]
    params = [
        SamplingParams(temperature=0.8, top_k=k, top_p=p, min_p=0.01 * (i % 2), logprobs=i % 3 or None)
        for i, (k, p) in enumerate(zip(top_k, top_p, strict=True))
    ]
    generators = [make_generator(i, logits.device) if i % 4 == 0 else None for i in range(rows)]
    batch = SamplingInputs(params, [[1]] * rows, [[2]] * rows, generators)
    sampler = Sampler()
    sampler.sample(logits, batch).output()  # warm-up: pinned buffers, kernel compilation
    messages: list[str] = []
    with sync_warnings(messages):
        sampled = sampler.sample(logits, batch)
        sampled.copy_to_host()
    sampled.output()
    return {"count": len(messages), "first": messages[:3]}


def section_kernels(settings: Settings, device: torch.device, seed: int) -> dict[str, Any]:
    cases: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for i, case in enumerate(attention_cases(settings.kernel_scale)):
        result = run_attention_case(case, device, seed + i)
        cases.append({"name": f"paged_attention {case.name}", **result})
    for dtype in (torch.bfloat16, torch.float32):
        result = run_write_kv_case(device, dtype, seed, settings.kernel_scale)
        cases.append({"name": f"write_kv {str(dtype).removeprefix('torch.')}", **result})
    for name, result in run_elementwise_cases(device, seed, settings.kernel_scale):
        cases.append({"name": name, **result})
    cases.append(
        {"name": "top-k/top-p thresholds", **run_threshold_case(device, seed, settings.kernel_scale)}
    )
    failed = [c["name"] for c in cases if not c["ok"]]
    return {
        "passed": not failed,
        "num_cases": len(cases),
        "num_passed": len(cases) - len(failed),
        "failed": failed,
        "cases": cases,
        "seconds": time.perf_counter() - t0,
    }
