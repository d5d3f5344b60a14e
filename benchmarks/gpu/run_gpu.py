#!/usr/bin/env python
"""pagedllm's GPU checks and benchmarks, all in one run.

1. ``kernels``: the Triton kernels (paged attention on mixed and padded decode batches, KV writes,
   RMSNorm, fused add + RMSNorm, SiLU-and-mul, top-k / top-p thresholds) against torch references on
   random shapes. Unused cache slots hold NaN, and a NaN anywhere in an output fails its case.
2. ``equivalence``: greedy generations of the default model (or ``--model``) against Hugging Face
   transformers on the same weights and dtype, by the logprob-close rule: identical, or at the first
   differing token each side's token is among the other's top-5; then the same comparison between
   the engine with CUDA graphs and with ``enforce_eager``.
3. ``throughput``: a model of Qwen3-0.6B's shape with random weights (written with transformers from
   a config, no download), 256 requests with random token prompts of 100-1024 tokens and outputs of
   100-1024 tokens, EOS ignored, seeded; output tokens per second of ``LLM.generate``.
4. ``decode``: decode steps with 256 running requests, in runs of consecutive steps with and without
   scheduling ahead (``async_scheduling``), and broken down into host work (input preparation,
   sampling, scheduling and output processing) against the forward, with the device synchronised
   around each; the CPU-side share of a step is what the step takes beyond the forward and sampling.
5. ``roofline``: the bytes a decode step must read (weights + KV cache) over the bandwidth of a large
   device-to-device copy, as a fraction of the measured step.
6. ``serve``: the OpenAI server (FastAPI app in this process, in-process client) streaming
   completions of the first 256 workload requests (outputs capped at 256 tokens), against
   ``LLM.generate`` on the same requests: output tokens per second of each.
7. ``hf``: transformers' continuous batching (the manager behind ``generate_batch``) on a subsample of
   the same requests, time-bounded, against the engine on that same subsample.

Run from the repository root (no installation needed; pagedllm is imported from this checkout)::

    python benchmarks/gpu/run_gpu.py --output-json gpu_results.json

``--tiny`` (alias ``--quick``) shrinks everything (a 2-layer Qwen3-shaped model, 8 requests, short
lengths) so that ``--tiny --device cpu`` runs on a CPU in about a minute. A short table is printed
last; the full results go to ``--output-json`` and, when ``$OUT`` is set, to ``$OUT/gpu_results.json``.
The exit status is 1 when a check fails or a section raises.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import gc
import importlib.util
import json
import logging
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from pagedllm.bench.hf_reference import greedy_compare, hf_greedy  # noqa: E402

logger = logging.getLogger("run_gpu")

SECTIONS = ("kernels", "equivalence", "throughput", "decode", "roofline", "serve", "hf")

EQUIVALENCE_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three prime numbers:",
    "Translate to French: I like apples.",
    "The quick brown fox",
    "1, 2, 3, 4, 5,",
    "Q: What is the boiling point of water in Celsius?\nA:",
]


# --------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------


@dataclass
class ModelShape:
    """A Qwen3-style decoder's shape (the random-weight throughput model)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int = 151936
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960


QWEN3_0_6B = ModelShape(1024, 28, 16, 8, 128, 3072)
TINY_QWEN3 = ModelShape(64, 2, 4, 2, 32, 128)
# The equivalence check's stand-in when the default model is not installed.
SMALL_QWEN3 = ModelShape(512, 4, 8, 4, 128, 1024)
# Weights ten times the usual initialisation scale give peaked next-token distributions, so that
# comparisons of greedy tokens are not dominated by near-ties.
SHARP_INIT = 0.2


@dataclass
class Settings:
    shape: ModelShape
    num_requests: int
    prompt_len: tuple[int, int]  # inclusive range
    output_len: tuple[int, int]
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    hf_requests: int
    hf_timeout_s: float
    serve_requests: int
    serve_max_output: int
    decode_running: int
    decode_prompt_len: int
    decode_steps: int
    equivalence_shape: ModelShape
    equivalence_prompts: int
    equivalence_tokens: int
    copy_bytes: int
    kernel_scale: str  # "full" or "tiny"


FULL = Settings(
    shape=QWEN3_0_6B,
    num_requests=256,
    prompt_len=(100, 1024),
    output_len=(100, 1024),
    max_model_len=2048,
    max_num_seqs=256,
    max_num_batched_tokens=8192,
    hf_requests=64,
    hf_timeout_s=150.0,
    serve_requests=256,
    serve_max_output=256,
    decode_running=256,
    decode_prompt_len=512,
    decode_steps=20,
    equivalence_shape=SMALL_QWEN3,
    equivalence_prompts=8,
    equivalence_tokens=32,
    copy_bytes=1 << 30,
    kernel_scale="full",
)
TINY = Settings(
    shape=TINY_QWEN3,
    num_requests=8,
    prompt_len=(8, 48),
    output_len=(4, 16),
    max_model_len=128,
    max_num_seqs=8,
    max_num_batched_tokens=256,
    hf_requests=4,
    hf_timeout_s=60.0,
    serve_requests=8,
    serve_max_output=16,
    decode_running=8,
    decode_prompt_len=16,
    decode_steps=3,
    equivalence_shape=TINY_QWEN3,
    equivalence_prompts=2,
    equivalence_tokens=6,
    copy_bytes=64 << 20,
    kernel_scale="tiny",
)


# --------------------------------------------------------------------------------------------------
# Small utilities
# --------------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def finite_or_none(value: Any) -> Any:
    """NaN and infinities become None (JSON has no such numbers), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def write_json(path: str, data: dict[str, Any]) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(finite_or_none(data), f, indent=2, default=str)
        f.write("\n")


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def machine_info(device: torch.device) -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_count": os.cpu_count(),
        "device": str(device),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            gpu_memory_gib=props.total_memory / 2**30,
            gpu_sms=props.multi_processor_count,
            cuda=torch.version.cuda,
        )
    return info


class Deadline:
    """The run's time budget."""

    def __init__(self, budget_s: float) -> None:
        self.start = time.perf_counter()
        self.budget_s = budget_s

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @property
    def remaining(self) -> float:
        return self.budget_s - self.elapsed


# --------------------------------------------------------------------------------------------------
# 1. Kernel checks
# --------------------------------------------------------------------------------------------------

TOLERANCES = {
    torch.float32: (2e-4, 2e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


def compare(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
    """Elementwise ``|actual - expected| <= atol + rtol * |expected|``; any NaN or inf fails."""
    atol, rtol = TOLERANCES[dtype]
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


class PagedBatch:
    """A batch of ``(query_len, seq_len)`` requests over a paged cache whose unused slots hold NaN.

    Physical blocks are shuffled. ``padding_rows`` appends decode rows in the CUDA-graph padding
    layout (slot -1, context of one position in block 0).
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
        device: torch.device,
        seed: int,
        padding_rows: int = 0,
    ) -> None:
        from pagedllm.attention.base import AttentionMetadata

        gen = torch.Generator().manual_seed(seed)
        self.requests = list(requests)
        self.num_heads = num_kv_heads * group
        self.scale = head_dim**-0.5
        blocks_per_req = [-(-s // block_size) for _, s in requests]
        num_blocks = sum(blocks_per_req) + 1
        # Block 0 is reserved: padding rows read it; it holds finite values.
        physical = torch.randperm(num_blocks - 1, generator=gen) + 1
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k_cache = torch.full(shape, float("nan"))
        v_cache = torch.full(shape, float("nan"))
        k_cache[0] = torch.randn(shape[1:], generator=gen)
        v_cache[0] = torch.randn(shape[1:], generator=gen)
        tables = torch.zeros(len(requests) + padding_rows, max(blocks_per_req), dtype=torch.int32)
        self.block_ids: list[list[int]] = []
        used = 0
        for i, (_, seq_len) in enumerate(requests):
            ids = physical[used : used + blocks_per_req[i]]
            used += blocks_per_req[i]
            tables[i, : len(ids)] = ids.to(torch.int32)
            self.block_ids.append([int(b) for b in ids])
            for pos in range(0, seq_len, block_size):
                n = min(block_size, seq_len - pos)
                blk = int(ids[pos // block_size])
                k_cache[blk, :n] = torch.randn(n, num_kv_heads, head_dim, generator=gen)
                v_cache[blk, :n] = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        self.k_cache = k_cache.to(dtype).to(device)
        self.v_cache = v_cache.to(dtype).to(device)
        query_lens = [q for q, _ in requests] + [1] * padding_rows
        seq_lens = [s for _, s in requests] + [1] * padding_rows
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        self.num_real_tokens = starts[len(requests)]
        self.query = torch.randn(starts[-1], self.num_heads, head_dim, generator=gen).to(dtype).to(device)
        self.meta = AttentionMetadata(
            slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=tables.to(device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )

    def reference(self) -> torch.Tensor:
        """Causal attention of the real rows in float32 (torch, on CPU), gathering exactly the context."""
        k_cache, v_cache = self.k_cache.float().cpu(), self.v_cache.float().cpu()
        block_size, num_kv_heads, head_dim = k_cache.shape[1:]
        group = self.num_heads // num_kv_heads
        query = self.query.float().cpu()
        out = torch.zeros(self.num_real_tokens, self.num_heads, head_dim)
        start = 0
        for i, (query_len, seq_len) in enumerate(self.requests):
            blocks = torch.tensor(self.block_ids[i])
            k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].repeat_interleave(group, dim=1)
            v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].repeat_interleave(group, dim=1)
            q = query[start : start + query_len]
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            q_pos = torch.arange(seq_len - query_len, seq_len)
            visible = torch.arange(seq_len)[None, :] <= q_pos[:, None]
            probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
            out[start : start + query_len] = torch.einsum("hqk,khd->qhd", probs, v)
            start += query_len
        return out


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


def attention_cases(scale: str, device: torch.device) -> list[AttentionCase]:
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    mixed = [(1, 37), (9, 9), (5, 70), (1, 1), (17, 40), (1, 16)]
    if scale == "tiny":
        return [
            AttentionCase("mixed-fp32-d32-g2", mixed, 16, 2, 2, 32, f32),
            AttentionCase("decode-bf16-split4-padded", [(1, 50), (1, 3), (1, 33)], 16, 2, 2, 32, bf16, 4, 1),
        ]
    rng = random.Random(1234)
    random_mixed = [(rng.choice([1, 1, 1, rng.randint(2, 300)]), 0) for _ in range(24)]
    random_mixed = [(q, q + rng.randint(0, 1500)) for q, _ in random_mixed]
    long_decode = [(1, rng.randint(1, 4000)) for _ in range(32)]
    cases = [
        AttentionCase("mixed-bf16-d128-g2 (Qwen3)", mixed, 16, 8, 2, 128, bf16),
        AttentionCase("mixed-bf16-d64-g3 (SmolLM2)", mixed, 16, 3, 3, 64, bf16),
        AttentionCase("random-mixed-bf16-d128-g2", random_mixed, 16, 8, 2, 128, bf16),
        AttentionCase("long-decode-bf16-d128-auto", long_decode, 16, 8, 2, 128, bf16),
        AttentionCase("graph-decode-bf16-split8-padded", long_decode[:13], 16, 8, 2, 128, bf16, 8, 3),
        AttentionCase("graph-decode-bf16-split1-padded", long_decode[:5], 16, 8, 2, 128, bf16, 1, 3),
        AttentionCase("prefix-prefill-bf16-d128", [(700, 1000), (1, 5)], 16, 8, 2, 128, bf16),
        AttentionCase("mixed-fp16-d128-g4-bs32", mixed, 32, 2, 4, 128, f16),
        AttentionCase("mixed-fp32-d64-g1", mixed, 16, 4, 1, 64, f32),
    ]
    return cases


def run_attention_case(case: AttentionCase, device: torch.device, seed: int) -> dict[str, Any]:
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    batch = PagedBatch(
        case.requests,
        block_size=case.block_size,
        num_kv_heads=case.num_kv_heads,
        group=case.group,
        head_dim=case.head_dim,
        dtype=case.dtype,
        device=device,
        seed=seed,
        padding_rows=case.padding_rows,
    )
    backend = TritonAttentionBackend(num_splits=case.num_splits)
    config = backend.launch_config(batch.query, batch.k_cache, batch.meta)
    out = backend.forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    result = compare(out[: batch.num_real_tokens], batch.reference(), case.dtype)
    if case.padding_rows:
        # Padding rows attend to block 0: finite, whatever they hold.
        padded_finite = bool(torch.isfinite(out[batch.num_real_tokens :].float()).all())
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
    for i, case in enumerate(attention_cases(settings.kernel_scale, device)):
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


# --------------------------------------------------------------------------------------------------
# 2. Equivalence with transformers, and CUDA graphs against eager
# --------------------------------------------------------------------------------------------------


def engine_greedy(
    llm: Any, prompts: list[list[int]], max_tokens: int
) -> list[tuple[list[int], list[dict[int, float]]]]:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = []
    for out in outs:
        seq = out.outputs[0]
        tops = [{int(t): float(lp.logprob) for t, lp in step.items()} for step in seq.logprobs]
        result.append((list(seq.token_ids), tops))
    return result


def load_hf_model(model_arg: str | None, dtype: torch.dtype, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM

    from pagedllm.model.loader import resolve_model_path

    kind, path = resolve_model_path(model_arg)
    model: Any
    if kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), **hf_dtype(dtype)
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **hf_dtype(dtype))
    return model.to(device).eval()


def comparison_summary(statuses: list[tuple[str, int | None]]) -> dict[str, Any]:
    counts = {s: sum(1 for st, _ in statuses if st == s) for s in ("identical", "near_tie", "mismatch")}
    return {
        "passed": counts["mismatch"] == 0,
        **counts,
        "per_prompt": [{"status": s, "first_difference": i} for s, i in statuses],
    }


def small_engine_args(device: torch.device, dtype_name: str) -> dict[str, Any]:
    """Engine arguments for the equivalence checks: a small batch and a 2 GiB KV cache on GPUs."""
    args: dict[str, Any] = {
        "dtype": dtype_name,
        "device": str(device),
        "max_num_seqs": 8,
        "max_model_len": 512,
    }
    if device.type == "cuda":
        args["kv_cache_memory_bytes"] = 2 << 30
    return args


def section_equivalence(
    settings: Settings, device: torch.device, dtype_name: str, model_arg: str | None, random_prompts: bool
) -> dict[str, Any]:
    """The engine against transformers (and CUDA graphs against eager) on ``model_arg``'s greedy tokens.

    ``random_prompts``: seeded random token ids (for random-weight models) instead of text prompts.
    """
    from pagedllm import LLM
    from pagedllm.model.loader import resolve_model_path

    try:
        resolve_model_path(model_arg)
    except (FileNotFoundError, ValueError) as exc:
        return {"status": "skipped", "reason": str(exc)}
    t0 = time.perf_counter()
    dtype = getattr(torch, dtype_name)
    llm = LLM(model_arg, **small_engine_args(device, dtype_name))
    if random_prompts:
        rng = random.Random(5)
        vocab = llm.llm_engine.vocab_size
        prompts = [
            [rng.randrange(vocab) for _ in range(rng.randint(4, 40))]
            for _ in range(settings.equivalence_prompts)
        ]
    else:
        tokenizer = llm.get_tokenizer()
        prompts = [list(tokenizer(p).input_ids) for p in EQUIVALENCE_PROMPTS[: settings.equivalence_prompts]]
    n = settings.equivalence_tokens
    ours = engine_greedy(llm, prompts, n)
    result: dict[str, Any] = {
        "model": model_arg or "default",
        "dtype": dtype_name,
        "max_tokens": n,
        "prompts": "random token ids" if random_prompts else "text",
    }

    hf = load_hf_model(model_arg, dtype, device)
    statuses = []
    first_step_err = 0.0
    for prompt, (tokens, tops) in zip(prompts, ours, strict=True):
        hf_tokens, hf_tops = hf_greedy(hf, prompt, n)
        statuses.append(greedy_compare(tokens, tops, hf_tokens, hf_tops))
        for tok, lp in hf_tops[0].items():
            if tok in tops[0]:
                first_step_err = max(first_step_err, abs(tops[0][tok] - lp))
    del hf
    free_device_memory(device)
    result["vs_hf"] = {**comparison_summary(statuses), "first_step_max_logprob_diff": first_step_err}

    if device.type == "cuda" and llm.llm_engine.runner.cuda_graphs is not None:
        eager = LLM(model_arg, enforce_eager=True, **small_engine_args(device, dtype_name))
        eager_out = engine_greedy(eager, prompts, n)
        graph_statuses = [
            greedy_compare(a_tok, a_top, b_tok, b_top)
            for (a_tok, a_top), (b_tok, b_top) in zip(ours, eager_out, strict=True)
        ]
        result["graphs_vs_eager"] = comparison_summary(graph_statuses)
        del eager
    else:
        result["graphs_vs_eager"] = {"status": "skipped", "reason": "CUDA graphs need a CUDA device"}
    del llm
    free_device_memory(device)
    checks = [result["vs_hf"]["passed"]]
    if "passed" in result["graphs_vs_eager"]:
        checks.append(result["graphs_vs_eager"]["passed"])
    result["passed"] = all(checks)
    result["status"] = "passed" if result["passed"] else "failed"
    result["seconds"] = time.perf_counter() - t0
    return result


# --------------------------------------------------------------------------------------------------
# 3. The random-weight model and the workload
# --------------------------------------------------------------------------------------------------


def trivial_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer over ``<t0> ... <t{vocab_size-1}>`` (the benchmark feeds token ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<t0>", bos_token="<t1>", eos_token="<t2>", pad_token="<t0>"
    )


def write_random_model(
    shape: ModelShape,
    out_dir: str,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    initializer_range: float = 0.02,
) -> dict[str, Any]:
    """Write a Qwen3 checkpoint with random weights (normal, std ``initializer_range``) and a
    tokenizer into ``out_dir``."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from pagedllm.model.loader import default_model_path

    t0 = time.perf_counter()
    # transformers 5 folds rope_theta into rope_parameters; older versions take it as is.
    rope: dict[str, Any] = {"rope_theta": shape.rope_theta}
    config = Qwen3Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-6,
        initializer_range=initializer_range,
        tie_word_embeddings=True,
        bos_token_id=151643,  # Qwen3's <|endoftext|>
        eos_token_id=151645,  # Qwen3's <|im_end|>
        **rope,
    )
    torch.manual_seed(seed)
    model: Any
    try:
        with torch.device(device):  # initialising on the GPU is much faster
            model = AutoModelForCausalLM.from_config(config, **hf_dtype(dtype))
    except Exception as exc:  # pragma: no cover - depends on the transformers version
        logger.info("Initialising on %s failed (%s); initialising on the CPU.", device, exc)
        model = AutoModelForCausalLM.from_config(config, **hf_dtype(dtype))
    model.save_pretrained(out_dir)
    num_params = sum(p.numel() for p in model.parameters())
    del model
    free_device_memory(device)
    tokenizer_source = "trivial"
    try:
        from pagedllm.model.tokenizer import load_gguf_tokenizer

        load_gguf_tokenizer(default_model_path()).save_pretrained(out_dir)
        tokenizer_source = "default model"
    except Exception as exc:  # the default model package is optional here
        logger.info("Default model tokenizer unavailable (%s); writing a trivial tokenizer.", exc)
        trivial_tokenizer(shape.vocab_size).save_pretrained(out_dir)
    return {
        "path": out_dir,
        "initializer_range": initializer_range,
        "num_params": num_params,
        "tokenizer": tokenizer_source,
        "seconds": time.perf_counter() - t0,
        **asdict(shape),
    }


@dataclass
class WorkloadRequest:
    prompt_token_ids: list[int]
    output_len: int


def make_workload(
    n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int, seed: int
) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        p = rng.randint(*prompt_len)
        requests.append(
            WorkloadRequest([rng.randrange(vocab_size) for _ in range(p)], rng.randint(*output_len))
        )
    return requests


# Buckets of running requests for the per-step trace of a workload run (lower bounds).
RUNNING_BUCKETS = (192, 128, 64, 16, 1, 0)


def step_trace(engine: Any, trace: list[tuple[int, int, float]]) -> Any:
    """A wrapper for ``engine.step`` appending (requests running and waiting before the step,
    seconds the call took). With scheduling ahead a call returns the previous step's outputs, so in
    a steady run the calls' times follow the device's steps."""

    def wrap(step: Callable[..., Any]) -> Callable[..., Any]:
        def inner(*args: Any, **kwargs: Any) -> Any:
            running, waiting = len(engine.scheduler.running), len(engine.scheduler.waiting)
            t = time.perf_counter()
            out = step(*args, **kwargs)
            trace.append((running, waiting, time.perf_counter() - t))
            return out

        return inner

    return wrap


@contextmanager
def gc_pauses(pauses: list[tuple[int, float]]) -> Iterator[None]:
    """Record (generation, seconds) of every garbage collection inside."""
    started: list[float] = []

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append((int(info["generation"]), time.perf_counter() - started.pop()))

    gc.callbacks.append(callback)
    try:
        yield
    finally:
        gc.callbacks.remove(callback)


def _trace_row(label: str, times: list[float]) -> dict[str, Any]:
    return {
        "running": label,
        "steps": len(times),
        "seconds": sum(times),
        "ms_per_step": 1e3 * mean(times),
        "max_ms": 1e3 * max(times),
    }


def summarize_trace(trace: list[tuple[int, int, float]]) -> list[dict[str, Any]]:
    """Steps and seconds per bucket of running requests; steps with requests still waiting (the
    prefill phase) in a row of their own."""
    prefill = [dt for _, waiting, dt in trace if waiting]
    rows = [_trace_row("requests waiting", prefill)] if prefill else []
    for i, lo in enumerate(RUNNING_BUCKETS):
        hi = RUNNING_BUCKETS[i - 1] - 1 if i else None
        times = [dt for n, waiting, dt in trace if not waiting and n >= lo and (hi is None or n <= hi)]
        if times:
            rows.append(
                _trace_row(
                    f"{lo}+ running"
                    if hi is None
                    else (f"{lo} running" if lo == hi else f"{lo}-{hi} running"),
                    times,
                )
            )
    return rows


def engine_run(
    llm: Any, requests: list[WorkloadRequest], temperature: float, trace_steps: bool = False
) -> dict[str, Any]:
    """``LLM.generate`` over the requests (EOS ignored); the engine's seed makes sampling repeatable.
    ``trace_steps`` adds the steps and seconds by number of running requests."""
    from pagedllm import SamplingParams

    params = [
        SamplingParams(temperature=temperature, max_tokens=r.output_len, ignore_eos=True) for r in requests
    ]
    engine = llm.llm_engine
    device = engine.device
    trace: list[tuple[int, int, float]] = []
    pauses: list[tuple[int, float]] = []
    tracing = contextlib.ExitStack()
    if trace_steps:
        tracing.enter_context(patched(engine, "step", step_trace(engine, trace)))
        tracing.enter_context(gc_pauses(pauses))
    synchronize(device)
    start = time.perf_counter()
    with tracing:
        outs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    synchronize(device)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    return {
        "num_requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "expected_output_tokens": sum(r.output_len for r in requests),
        "elapsed_s": elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "requests_per_s": len(requests) / elapsed,
        **(
            {
                "steps_by_running": summarize_trace(trace),
                "slowest_steps": [
                    {"running": n, "waiting": w, "ms": 1e3 * dt}
                    for n, w, dt in sorted(trace, key=lambda x: -x[2])[:8]
                ],
                "gc_pauses": {
                    "count": len(pauses),
                    "seconds": sum(dt for _, dt in pauses),
                    "max_ms": 1e3 * max((dt for _, dt in pauses), default=0.0),
                    "full_collections": sum(1 for g, _ in pauses if g == 2),
                },
            }
            if trace_steps
            else {}
        ),
    }


def warm_up(llm: Any, vocab_size: int, settings: Settings) -> float:
    """A few short mixed batches so that kernel compilation is not timed."""
    from pagedllm import SamplingParams

    t0 = time.perf_counter()
    rng = random.Random(99)
    lengths = [1, 5, 16, 17, 33, 100, 250]
    prompts = [
        [rng.randrange(vocab_size) for _ in range(min(n, settings.max_model_len - 8))] for n in lengths
    ]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.generate(prompts[:3], SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.llm_engine.reset_prefix_cache()
    return time.perf_counter() - t0


# --------------------------------------------------------------------------------------------------
# 4. Decode step breakdown
# --------------------------------------------------------------------------------------------------


@contextmanager
def patched(
    obj: Any, name: str, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Iterator[None]:
    """Temporarily set the instance attribute ``obj.name`` to ``wrapper(obj.name)``."""
    own = vars(obj)
    had_own = name in own
    previous = own.get(name)
    setattr(obj, name, wrapper(getattr(obj, name)))
    try:
        yield
    finally:
        if had_own:
            setattr(obj, name, previous)
        else:
            delattr(obj, name)


# Torch warns once, when the mode is first set, that it is a prototype; that is no synchronising call.
_SYNC_DEBUG_NOTICE = "Synchronization debug mode is a prototype"


@contextmanager
def sync_warnings(messages: list[str]) -> Iterator[None]:
    """Append to ``messages`` the first line of every synchronising CUDA call made inside (as
    ``torch.cuda.set_sync_debug_mode`` reports them)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
            texts = [str(w.message) for w in caught]
            messages.extend(t.splitlines()[0] for t in texts if not t.startswith(_SYNC_DEBUG_NOTICE))


def count_launch_syncs(engine: Any, device: torch.device, steps: int = 3) -> dict[str, Any] | None:
    """Synchronising CUDA calls made while launching decode steps scheduled ahead (which should make
    none: a launch only queues work), as ``torch.cuda.set_sync_debug_mode`` reports them."""
    if device.type != "cuda":
        return None
    runner = engine.runner
    messages: list[str] = []

    def wrap(launch: Callable[..., Any]) -> Callable[..., Any]:
        def inner(*args: Any, **kwargs: Any) -> Any:
            with sync_warnings(messages):
                return launch(*args, **kwargs)

        return inner

    with patched(runner, "launch", wrap):
        for _ in range(steps):
            engine.step()
    return {"launches": steps, "warnings": len(messages), "first": messages[:3]}


def section_decode(llm: Any, settings: Settings, seed: int, temperature: float) -> dict[str, Any]:
    """Host work against the forward in decode steps with ``decode_running`` requests running.

    The requests return only their final output, as those of ``LLM.generate`` (the throughput
    workload) do."""
    from pagedllm import RequestOutputKind, SamplingParams

    engine = llm.llm_engine
    runner = engine.runner
    device = engine.device
    engine.reset_prefix_cache()
    rng = random.Random(seed + 7)
    vocab = engine.vocab_size
    n = settings.decode_running
    prompt_len = settings.decode_prompt_len
    ids = [f"decode-{i}" for i in range(n)]
    for rid in ids:
        engine.add_request(
            rid,
            [rng.randrange(vocab) for _ in range(prompt_len)],
            SamplingParams(
                temperature=temperature,
                max_tokens=settings.max_model_len - prompt_len,
                ignore_eos=True,
                output_kind=RequestOutputKind.FINAL_ONLY,
            ),
        )
    sched = engine.scheduler
    t0 = time.perf_counter()
    for _ in range(10_000):
        prefilling = sched.num_waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in sched.running
        )
        if not prefilling:
            break
        engine.step()
    prefill_s = time.perf_counter() - t0
    num_running = sched.num_running

    def context_tokens() -> int:
        return sum(r.num_computed_tokens + 1 for r in sched.running)

    default_async = engine.async_scheduling
    contexts: list[int] = []

    def steady_step(async_scheduling: bool) -> float:
        """Seconds a step in a run of consecutive steps, no synchronisation inside the run."""
        engine.async_scheduling = async_scheduling
        for _ in range(2):  # the first step in a new mode also resolves a step left in flight
            engine.step()
        synchronize(device)
        contexts.append(context_tokens())
        t = time.perf_counter()
        for _ in range(settings.decode_steps):
            engine.step()
        synchronize(device)
        contexts.append(context_tokens())
        return (time.perf_counter() - t) / settings.decode_steps

    sync_step = steady_step(False)
    async_step = steady_step(True)
    launch_syncs = count_launch_syncs(engine, device)
    engine.async_scheduling = False  # the breakdown below synchronises around every phase anyway
    engine.step()

    timers: dict[str, list[float]] = {"prepare": [], "forward": [], "sample": [], "step": []}

    def timed(name: str, sync_before: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            def inner(*args: Any, **kwargs: Any) -> Any:
                if sync_before:
                    synchronize(device)
                t = time.perf_counter()
                result = fn(*args, **kwargs)
                synchronize(device)
                timers[name].append(time.perf_counter() - t)
                return result

            return inner

        return wrap

    graphs = runner.cuda_graphs
    with (
        patched(runner.sampler, "sample", timed("sample")),
        patched(graphs or runner, "load_inputs" if graphs else "prepare_inputs", timed("prepare")),
        patched(graphs or runner.model, "replay" if graphs else "forward", timed("forward", True)),
        patched(runner.model, "compute_logits", timed("forward", True)),
    ):
        for _ in range(settings.decode_steps):
            contexts.append(context_tokens())
            synchronize(device)
            t = time.perf_counter()
            engine.step()
            synchronize(device)
            timers["step"].append(time.perf_counter() - t)
    engine.async_scheduling = default_async
    engine.abort_request(ids)
    engine.reset_prefix_cache()

    steps = len(timers["step"])
    forward = sum(timers["forward"]) / steps
    prepare = sum(timers["prepare"]) / steps
    sample = sum(timers["sample"]) / steps
    step = mean(timers["step"])
    device_work = forward + sample
    return {
        "num_running": num_running,
        "prompt_len": prompt_len,
        "cuda_graphs": graphs is not None,
        "async_scheduling_default": default_async,
        "prefill_s": prefill_s,
        "steps_measured": steps,
        "mean_context_tokens": mean([float(c) for c in contexts]),
        "mean_context_per_request": mean([c / max(num_running, 1) for c in contexts]),
        "plain_step_ms": 1e3 * (async_step if default_async else sync_step),
        "sync_step_ms": 1e3 * sync_step,
        "async_step_ms": 1e3 * async_step,
        "step_ms": 1e3 * step,
        "forward_ms": 1e3 * forward,
        "prepare_ms": 1e3 * prepare,
        "sample_ms": 1e3 * sample,
        "other_host_ms": 1e3 * (step - forward - prepare - sample),
        "host_overhead_ms": 1e3 * (step - forward),
        "host_overhead_fraction": (step - forward) / step,
        "sync_overhead_fraction": max(0.0, sync_step - device_work) / sync_step,
        "async_overhead_fraction": max(0.0, async_step - device_work) / async_step,
        "launch_sync_warnings": launch_syncs,
        "output_tokens_per_s_at_this_batch": num_running / (async_step if default_async else sync_step),
        "note": "sync_step_ms / async_step_ms: consecutive steps, no synchronisation inside, without and "
        "with scheduling ahead. The breakdown synchronises around every phase: prepare = inputs staged "
        "and copied; forward = graph replay or eager model + logits; sample = sampler; other = "
        "scheduling, output processing, detokenization. *_overhead_fraction = (step - forward - "
        "sample) / step: the share of a step the device is not running the forward or sampling.",
    }


def section_serve(
    llm: Any, requests: list[WorkloadRequest], temperature: float, max_output: int
) -> dict[str, Any]:
    """The OpenAI server streaming completions of the same requests the engine then runs offline.

    The FastAPI app runs in this process with an in-process HTTP client (``httpx.ASGITransport``,
    reading raw bytes; only each stream's final usage event is parsed), so the engine thread, the
    event loop and the client share the interpreter lock as they would in a server process that also
    hosted its clients: a conservative measure of the server's own host cost.
    """
    import httpx

    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.engine.metrics import EngineMetrics
    from pagedllm.entrypoints.openai.api_server import ServerSettings, build_app

    reqs = [WorkloadRequest(r.prompt_token_ids, min(r.output_len, max_output)) for r in requests]
    engine = llm.llm_engine
    engine.reset_prefix_cache()
    offline = engine_run(llm, reqs, temperature)
    engine.reset_prefix_cache()
    metrics = EngineMetrics("bench")
    app = build_app(
        AsyncLLMEngine(engine, metrics=metrics, log_stats_interval=None),
        ServerSettings(served_model_names=["bench"]),
        metrics,
    )

    async def one(client: httpx.AsyncClient, r: WorkloadRequest) -> int:
        body = {
            "model": "bench",
            "prompt": r.prompt_token_ids,
            "max_tokens": r.output_len,
            "temperature": temperature,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        tail = b""
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for chunk in resp.aiter_raw():
                tail = (tail + chunk)[-8192:]
        events = [e for e in tail.decode(errors="replace").split("\n\n") if e.startswith("data: {")]
        return int(json.loads(events[-1][len("data: ") :])["usage"]["completion_tokens"])

    async def serve() -> tuple[float, list[int]]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://bench", timeout=600) as client:
                start = time.perf_counter()
                counts = await asyncio.gather(*(one(client, r) for r in reqs))
                return time.perf_counter() - start, list(counts)

    steps_before = engine.step_times.steps
    cpu_before = time.process_time()
    elapsed, counts = asyncio.run(serve())
    cpu = time.process_time() - cpu_before
    steps = engine.step_times.steps - steps_before
    engine.reset_prefix_cache()
    output_tokens = sum(counts)
    server_rate = output_tokens / elapsed
    return {
        "num_requests": len(reqs),
        "max_output_tokens": max_output,
        "offline": offline,
        "server": {
            "elapsed_s": elapsed,
            "output_tokens": output_tokens,
            "output_tokens_per_s": server_rate,
            "steps": steps,
            "ms_per_step": 1e3 * elapsed / max(steps, 1),
            "process_cpu_ms_per_step": 1e3 * cpu / max(steps, 1),
        },
        "server_over_offline": server_rate / offline["output_tokens_per_s"],
        "passed": output_tokens == offline["expected_output_tokens"],
        "note": "Streamed /v1/completions of the first requests of the workload (outputs capped at "
        "max_output_tokens), all at once, through the FastAPI app and an in-process client, against "
        "LLM.generate on the same requests just before.",
    }


# --------------------------------------------------------------------------------------------------
# 5. Roofline
# --------------------------------------------------------------------------------------------------


def best_time(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds of the fastest of 10 calls of ``fn`` (after 2 untimed), the device synchronised around each."""
    times = []
    for i in range(12):
        synchronize(device)
        t = time.perf_counter()
        fn()
        synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - t)
    return min(times)


def copy_bandwidth(device: torch.device, nbytes: int) -> dict[str, Any]:
    """Bandwidth of ``dst.copy_(src)`` on ``nbytes`` (bytes read + bytes written per second), best of 10."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.random_(0, 255)
    dst = torch.empty_like(src)
    best = best_time(functools.partial(dst.copy_, src), device)
    del src, dst
    free_device_memory(device)
    return {"bytes": nbytes, "best_s": best, "bytes_per_s": 2 * nbytes / best}


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """FLOP/s of an ``n`` x ``n`` x ``n`` matrix product on random data, best of 10."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / best_time(lambda: torch.mm(a, b), device)


def workload_roofline(
    requests: list[WorkloadRequest],
    weight_bytes: int,
    num_weights: int,
    kv_bytes_per_token: int,
    bytes_per_s: float,
    flops_per_s: float,
) -> dict[str, Any]:
    """The least time the whole workload could take: every decode step reads the weights once and
    the KV cache of every running request (all requests admitted at once, as the KV cache allows
    here) at the copy bandwidth, and the prompts cost their matrix products (2 FLOP per weight per
    token) at the measured FLOP rate. (``pagedllm bench``'s ``workload_floor`` bounds a CPU run,
    where decode steps can be compute-bound, from the CPU roofline's GEMM rates per row count.)"""
    steps = max(r.output_len for r in requests) - 1  # the first token of each comes from its prefill
    kv_tokens = sum(
        (r.output_len - 1) * len(r.prompt_token_ids) + r.output_len * (r.output_len - 1) // 2
        for r in requests
    )
    decode_s = (steps * weight_bytes + kv_tokens * kv_bytes_per_token) / bytes_per_s
    prefill_s = 2 * num_weights * sum(len(r.prompt_token_ids) for r in requests) / flops_per_s
    output_tokens = sum(r.output_len for r in requests)
    return {
        "decode_steps": steps,
        "ideal_decode_s": decode_s,
        "ideal_prefill_s": prefill_s,
        "ideal_s": decode_s + prefill_s,
        "ideal_output_tokens_per_s": output_tokens / (decode_s + prefill_s),
    }


def section_roofline(
    llm: Any,
    decode: dict[str, Any] | None,
    settings: Settings,
    requests: list[WorkloadRequest],
    throughput: dict[str, Any] | None,
    dtype: torch.dtype,
) -> dict[str, Any]:
    engine = llm.llm_engine
    runner = engine.runner
    device = engine.device
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_per_token = runner.kv_bytes_per_block // engine.config.block_size
    bw = copy_bandwidth(device, settings.copy_bytes)
    flops = matmul_flops(device, dtype, 8192 if device.type == "cuda" else 256)
    result: dict[str, Any] = {
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
        "copy_bandwidth_GBps": bw["bytes_per_s"] / 1e9,
        "copy_bytes": bw["bytes"],
        "matmul_TFLOPs": flops / 1e12,
    }
    if throughput is not None and "engine" in throughput:
        num_weights = sum(p.numel() for p in runner.model.parameters())
        ideal = workload_roofline(requests, weight_bytes, num_weights, kv_per_token, bw["bytes_per_s"], flops)
        measured = throughput["engine"]["output_tokens_per_s"]
        result["workload"] = {
            **ideal,
            "measured_s": throughput["engine"]["elapsed_s"],
            "measured_output_tokens_per_s": measured,
            "fraction_of_roofline": measured / ideal["ideal_output_tokens_per_s"],
        }
    if decode:
        kv_bytes = decode["mean_context_tokens"] * kv_per_token
        total = weight_bytes + kv_bytes
        ideal = total / bw["bytes_per_s"]
        result.update(
            num_running=decode["num_running"],
            kv_bytes=kv_bytes,
            bytes_per_step=total,
            ideal_step_ms=1e3 * ideal,
            measured_forward_ms=decode["forward_ms"],
            measured_step_ms=decode["plain_step_ms"],
            fraction_of_roofline_forward=1e3 * ideal / decode["forward_ms"],
            fraction_of_roofline_step=1e3 * ideal / decode["plain_step_ms"],
        )
    return result


# --------------------------------------------------------------------------------------------------
# 6. transformers' continuous batching
# --------------------------------------------------------------------------------------------------


def hf_dtype(dtype: torch.dtype) -> dict[str, Any]:
    """The dtype keyword of transformers' model constructors (``torch_dtype`` before 4.56)."""
    import transformers
    from packaging.version import Version

    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return {key: dtype}


def hf_sampling(temperature: float) -> dict[str, Any]:
    if temperature > 0:
        return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    return {"do_sample": False}


# Not inference_mode: transformers' continuous batching updates its cache in place from a thread of
# its own, which (in some transformers 5 releases) is not in inference mode, so its tensors must not
# be inference tensors.
@torch.no_grad()
def run_hf_continuous_batching(
    model_dir: str,
    requests: list[WorkloadRequest],
    device: torch.device,
    dtype: torch.dtype,
    temperature: float,
    max_batch_tokens: int,
    timeout_s: float,
    seed: int,
) -> dict[str, Any]:
    """The requests through transformers' continuous batching (see :func:`_hf_manager_run`)."""
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model: Any = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="sdpa", **hf_dtype(dtype)
    )
    model = model.to(device).eval()
    load_s = time.perf_counter() - t0
    try:
        try:
            from transformers import ContinuousBatchingConfig  # noqa: F401
            from transformers.generation.continuous_batching.utils import WorkloadHints  # noqa: F401
        except ImportError:
            out = _hf_generate_batch_run(model, requests, device, temperature, max_batch_tokens)
        else:
            out = _hf_manager_run(model, requests, device, temperature, max_batch_tokens, timeout_s, seed)
        out["attn_implementation"] = str(model.config._attn_implementation)
    finally:
        destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
        if destroy is not None:
            destroy()
        del model
        free_device_memory(device)
    out["load_s"] = load_s
    out["max_batch_tokens"] = max_batch_tokens
    out["num_requests"] = len(requests)
    out["expected_output_tokens"] = sum(r.output_len for r in requests)
    out["output_tokens_per_s"] = out["output_tokens"] / out["elapsed_s"]
    return out


def _hf_manager_run(
    model: Any,
    requests: list[WorkloadRequest],
    device: torch.device,
    temperature: float,
    max_batch_tokens: int,
    timeout_s: float,
    seed: int,
) -> dict[str, Any]:
    """The continuous batching manager that ``generate_batch`` wraps, used directly (transformers 5)
    so that each request gets its own ``max_new_tokens`` and the run can stop after ``timeout_s``.
    EOS is disabled; the KV cache holds every request at once."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    page_size = 256
    # The field names moved between transformers 5 releases (block_size became page_size; seed and
    # auto_switch_to_flash came later): pass those the installed version has.
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    wanted = {
        "page_size" if "page_size" in fields else "block_size": page_size,
        "num_blocks": sum(-(-(len(r.prompt_token_ids) + r.output_len) // page_size) for r in requests) + 1,
        "max_batch_tokens": max_batch_tokens,
        "seed": seed,
        # Without the flash-attn package, switching would try to fetch kernels from the Hub.
        "auto_switch_to_flash": importlib.util.find_spec("flash_attn") is not None,
    }
    cb_config = ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in fields})
    gen_config = GenerationConfig(
        max_new_tokens=max(r.output_len for r in requests),
        eos_token_id=-1,
        pad_token_id=0,
        **hf_sampling(temperature),
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(r.prompt_token_ids) for r in requests),
        max_generated_length=max(r.output_len for r in requests),
        num_requests=len(requests),
    )
    results: dict[str, Any] = {}
    timed_out = False
    t0 = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=gen_config,
        continuous_batching_config=cb_config,
        workload_hints=hints,
        block=True,
        timeout=30,
    ) as manager:
        startup_s = time.perf_counter() - t0
        synchronize(device)
        start = time.perf_counter()
        for i, r in enumerate(requests):
            manager.add_request(
                list(r.prompt_token_ids), request_id=f"r{i}", max_new_tokens=r.output_len, eos_token_id=-1
            )
        deadline = start + timeout_s
        while len(results) < len(requests):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped early")
            if time.perf_counter() > deadline:
                timed_out = True
                break
        synchronize(device)
        elapsed = time.perf_counter() - start
    errors = [r.error for r in results.values() if r.error is not None]
    if results and len(errors) == len(results):
        raise RuntimeError(f"every request failed in transformers' continuous batching: {errors[0]}")
    return {
        "api": "continuous_batching_context_manager + add_request (per-request max_new_tokens)",
        "completed_requests": len(results),
        "timed_out": timed_out,
        "errors": errors[:3],
        "output_tokens": sum(len(r.generated_tokens) for r in results.values()),
        "elapsed_s": elapsed,
        "startup_s": startup_s,
        "note": "completed requests only (time limit reached)" if timed_out else "all requests completed",
    }


def _hf_generate_batch_run(
    model: Any,
    requests: list[WorkloadRequest],
    device: torch.device,
    temperature: float,
    max_batch_tokens: int,
) -> dict[str, Any]:
    """``model.generate_batch`` (transformers 4.5x): one ``max_new_tokens`` for all requests, so every
    request generates the longest output; only the tokens each request asked for are counted."""
    from transformers import GenerationConfig

    gen_config = GenerationConfig(
        max_new_tokens=max(r.output_len for r in requests),
        eos_token_id=-1,
        pad_token_id=0,
        max_batch_tokens=max_batch_tokens,
        **hf_sampling(temperature),
    )
    synchronize(device)
    start = time.perf_counter()
    outputs = model.generate_batch(
        inputs=[list(r.prompt_token_ids) for r in requests], generation_config=gen_config
    )
    synchronize(device)
    elapsed = time.perf_counter() - start
    ordered = list(outputs.values())
    counted = sum(min(len(o.generated_tokens), r.output_len) for o, r in zip(ordered, requests, strict=False))
    return {
        "api": "generate_batch (one max_new_tokens for all requests)",
        "completed_requests": len(ordered),
        "timed_out": False,
        "errors": [],
        "output_tokens": counted,
        "computed_output_tokens": sum(len(o.generated_tokens) for o in ordered),
        "elapsed_s": elapsed,
        "startup_s": None,
        "note": "every request generated the longest output length; requested tokens are counted",
    }


# --------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------


def run_section(
    results: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]
) -> dict[str, Any] | None:
    logger.info("== %s ==", name)
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as exc:
        logger.error("section %s failed: %s", name, exc)
        results[name] = {
            "status": "error",
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
            "seconds": time.perf_counter() - t0,
        }
        return None
    out.setdefault("seconds", time.perf_counter() - t0)
    results[name] = out
    return out


def fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def summary_rows(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []

    def status(sec: dict[str, Any] | None) -> str:
        if sec is None:
            return "not run"
        if "passed" in sec:
            return "passed" if sec["passed"] else "FAILED"
        return str(sec.get("status", "ok"))

    k = results.get("kernels")
    rows.append(
        (
            "kernels",
            "cases passed",
            f"{k['num_passed']}/{k['num_cases']}" if k and "num_cases" in k else status(k),
        )
    )
    thresholds = (
        next((c for c in k.get("cases", []) if c["name"] == "top-k/top-p thresholds"), None) if k else None
    )
    if thresholds and "filter_ms" in thresholds:
        rows.append(
            ("kernels", f"top-k/top-p filter ms ({thresholds['rows']} rows)", fmt(thresholds["filter_ms"], 3))
        )
        rows.append(
            (
                "kernels",
                "syncs sampling top-k/top-p rows",
                str(thresholds["sampler_syncs"].get("count", thresholds["sampler_syncs"].get("error"))),
            )
        )
    e = results.get("equivalence")
    if e and "vs_hf" in e:
        v = e["vs_hf"]
        rows.append(
            (
                "equivalence",
                "vs HF identical/near-tie/mismatch",
                f"{v['identical']}/{v['near_tie']}/{v['mismatch']}",
            )
        )
        g = e["graphs_vs_eager"]
        rows.append(
            (
                "equivalence",
                "graphs vs eager identical/near-tie/mismatch",
                f"{g['identical']}/{g['near_tie']}/{g['mismatch']}"
                if "identical" in g
                else g.get("status", "-"),
            )
        )
    else:
        rows.append(("equivalence", "status", status(e) + (f" ({e.get('reason', '')[:60]})" if e else "")))
    t = results.get("throughput")
    if t and "engine" in t:
        rows.append(
            (
                "startup",
                "engine start-up s (graph capture s)",
                f"{fmt(t['startup_s'])} ({fmt(t.get('cuda_graph_capture_s'))})",
            )
        )
        rows.append(
            (
                "throughput",
                f"pagedllm output tok/s ({t['engine']['num_requests']} req)",
                fmt(t["engine"]["output_tokens_per_s"]),
            )
        )
        if "engine_again" in t:
            rows.append(
                (
                    "throughput",
                    "pagedllm output tok/s, second run",
                    fmt(t["engine_again"]["output_tokens_per_s"]),
                )
            )
        for b in t["engine"].get("steps_by_running", []):
            rows.append(
                (
                    "throughput",
                    f"steps ({b['running']}): count, s, ms/step",
                    f"{b['steps']}, {fmt(b['seconds'], 2)}, {fmt(b['ms_per_step'], 2)}",
                )
            )
    else:
        rows.append(("throughput", "status", status(t)))
    h = results.get("hf")
    if h and "hf" in h:
        rows.append(
            (
                "hf",
                f"HF continuous batching output tok/s ({h['hf']['completed_requests']}/{h['hf']['num_requests']} req)",
                fmt(h["hf"]["output_tokens_per_s"]),
            )
        )
        rows.append(
            (
                "hf",
                f"pagedllm on the same {h['engine']['num_requests']} req, tok/s",
                fmt(h["engine"]["output_tokens_per_s"]),
            )
        )
        rows.append(("hf", "speedup (same requests)", fmt(h.get("speedup"), 2) + "x"))
    else:
        rows.append(("hf", "status", status(h)))
    d = results.get("decode")
    if d and "step_ms" in d:
        rows.append(
            (
                "decode",
                f"step ms @{d['num_running']} running (sync / ahead / instrumented)",
                f"{fmt(d['sync_step_ms'], 2)} / {fmt(d['async_step_ms'], 2)} / {fmt(d['step_ms'], 2)}",
            )
        )
        rows.append(
            (
                "decode",
                "forward / prepare / sample / other ms",
                " / ".join(
                    fmt(d[key], 2) for key in ("forward_ms", "prepare_ms", "sample_ms", "other_host_ms")
                ),
            )
        )
        rows.append(
            (
                "decode",
                "CPU-side share of step (sync / ahead)",
                f"{fmt(100 * d['sync_overhead_fraction'])}% / {fmt(100 * d['async_overhead_fraction'])}%",
            )
        )
        syncs = d.get("launch_sync_warnings")
        if syncs:
            rows.append(
                ("decode", "synchronising calls in launches", f"{syncs['warnings']} in {syncs['launches']}")
            )
    else:
        rows.append(("decode", "status", status(d)))
    r = results.get("roofline")
    if r and "bytes_per_step" in r:
        rows.append(("roofline", "bytes per decode step (GB)", fmt(r["bytes_per_step"] / 1e9, 3)))
        rows.append(("roofline", "copy bandwidth (GB/s)", fmt(r["copy_bandwidth_GBps"])))
        rows.append(
            (
                "roofline",
                "roofline fraction (forward / whole step)",
                f"{fmt(100 * r['fraction_of_roofline_forward'])}% / {fmt(100 * r['fraction_of_roofline_step'])}%",
            )
        )
    if r and "workload" in r:
        w = r["workload"]
        rows.append(
            (
                "roofline",
                "workload: ideal s (decode + prefill) / measured s",
                f"{fmt(w['ideal_decode_s'], 2)} + {fmt(w['ideal_prefill_s'], 2)} / {fmt(w['measured_s'], 2)}",
            )
        )
        rows.append(("roofline", "workload roofline fraction", f"{fmt(100 * w['fraction_of_roofline'])}%"))
    if not r or "bytes_per_step" not in r:
        rows.append(("roofline", "status", status(r)))
    sv = results.get("serve")
    if sv and "server" in sv:
        rows.append(
            (
                "serve",
                f"streamed server / offline tok/s ({sv['num_requests']} req)",
                f"{fmt(sv['server']['output_tokens_per_s'])} / {fmt(sv['offline']['output_tokens_per_s'])}"
                f" = {fmt(100 * sv['server_over_offline'])}%",
            )
        )
        rows.append(("serve", "server ms per step", fmt(sv["server"]["ms_per_step"], 2)))
    else:
        rows.append(("serve", "status", status(sv)))
    rows.append(("overall", "checks", "passed" if results.get("passed") else "FAILED"))
    return rows


def format_table(rows: list[tuple[str, str, str]]) -> str:
    widths = [max(len(r[i]) for r in rows + [("section", "metric", "value")]) for i in range(3)]
    lines = [f"{'section':<{widths[0]}}  {'metric':<{widths[1]}}  {'value':>{widths[2]}}"]
    lines.append("  ".join("-" * w for w in widths))
    lines += [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}" for a, b, c in rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", "--quick", dest="tiny", action="store_true", help="tiny model and workload")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--output-json", default="gpu_results.json")
    p.add_argument(
        "--model", default=None, help="checkpoint for the HF equivalence check (default model if unset)"
    )
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--hf-requests", type=int, default=None, help="subsample of the workload for transformers")
    p.add_argument("--hf-timeout-s", type=float, default=None)
    p.add_argument("--time-budget-s", type=float, default=450.0, help="the transformers run is cut to fit")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the workload")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--attention-backend", default=None, choices=["torch", "triton"])
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", default="", help=f"comma-separated sections to skip: {', '.join(SECTIONS)}")
    return p.parse_args(argv)


class Run:
    """One run of the sections, sharing the random-weight model and one engine between them."""

    def __init__(
        self, args: argparse.Namespace, settings: Settings, device: torch.device, workdir: str
    ) -> None:
        self.args = args
        self.settings = settings
        self.device = device
        self.dtype_name: str = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
        self.dtype: torch.dtype = getattr(torch, self.dtype_name)
        self.workdir = workdir
        self.deadline = Deadline(args.time_budget_s)
        self.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
        self.results: dict[str, Any] = {}
        self.model_dir: str | None = None
        self.llm: Any = None
        self.requests = make_workload(
            settings.num_requests,
            settings.prompt_len,
            settings.output_len,
            settings.shape.vocab_size,
            args.seed,
        )

    def wants(self, *sections: str) -> bool:
        return any(s not in self.skip for s in sections)

    def section(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """Run one section, then save the results so far (a run cut short keeps what it measured)."""
        out = run_section(self.results, name, fn)
        self.save(final=False)
        return out

    def save(self, final: bool) -> None:
        """Write the results to ``--output-json`` and, when ``$OUT`` is set, to ``$OUT/gpu_results.json``."""
        self.results["complete"] = final
        self.results["total_seconds"] = self.deadline.elapsed
        write_json(self.args.output_json, self.results)
        out_dir = os.environ.get("OUT")
        if out_dir:
            write_json(os.path.join(out_dir, "gpu_results.json"), self.results)

    def run(self) -> None:
        args, settings, device = self.args, self.settings, self.device
        if self.wants("kernels"):
            self.section("kernels", lambda: section_kernels(settings, device, args.seed))
        # --tiny shares one sharp tiny model between the equivalence check and the benchmarks.
        tiny_reference = args.tiny and args.model is None and self.wants("equivalence")
        if self.wants("throughput", "decode", "roofline", "serve", "hf") or tiny_reference:
            info = self.section(
                "random_model",
                lambda: write_random_model(
                    settings.shape,
                    os.path.join(self.workdir, "qwen3-random"),
                    device,
                    self.dtype,
                    args.seed,
                    initializer_range=SHARP_INIT if args.tiny else 0.02,
                ),
            )
            self.model_dir = info["path"] if info is not None else None
        if self.wants("equivalence"):
            self.run_equivalence(tiny_reference)
        if self.model_dir is None or not self.wants("throughput", "decode", "roofline", "serve", "hf"):
            return
        throughput = self.section("throughput", self.section_throughput)
        if self.llm is None:
            return
        decode = None
        if self.wants("decode"):
            decode = self.section(
                "decode",
                lambda: section_decode(self.llm, settings, args.seed, args.temperature),
            )
        if self.wants("roofline"):
            self.section(
                "roofline",
                lambda: section_roofline(self.llm, decode, settings, self.requests, throughput, self.dtype),
            )
        if self.wants("serve"):
            self.section(
                "serve",
                lambda: section_serve(
                    self.llm,
                    self.requests[: settings.serve_requests],
                    args.temperature,
                    settings.serve_max_output,
                ),
            )
        if self.wants("hf") and throughput is not None:
            self.section("hf", self.section_hf)
        self.llm = None

    def run_equivalence(self, tiny_reference: bool) -> None:
        """Against ``--model``; else the default model when installed; else a small sharp random model."""
        from pagedllm.model.loader import default_model_path

        args, settings = self.args, self.settings
        reference: str | None = args.model
        random_model = False
        if tiny_reference:
            reference, random_model = self.model_dir, True
            if reference is None:
                self.results["equivalence"] = {"status": "error", "error": "the tiny model was not written"}
                return
        elif args.model is None:
            try:
                default_model_path()
            except FileNotFoundError as exc:
                logger.info("%s; checking equivalence on a small random Qwen3 instead.", exc)
                info = self.section(
                    "equivalence_model",
                    lambda: write_random_model(
                        settings.equivalence_shape,
                        os.path.join(self.workdir, "qwen3-small-sharp"),
                        self.device,
                        self.dtype,
                        args.seed + 1,
                        initializer_range=SHARP_INIT,
                    ),
                )
                if info is None:
                    return
                reference, random_model = info["path"], True
        self.section(
            "equivalence",
            lambda: section_equivalence(settings, self.device, self.dtype_name, reference, random_model),
        )

    def section_throughput(self) -> dict[str, Any]:
        """Start the engine (timed), warm it up, then run the whole workload."""
        from pagedllm import LLM

        settings, args = self.settings, self.args
        free_device_memory(self.device)
        t0 = time.perf_counter()
        self.llm = LLM(
            self.model_dir,
            dtype=self.dtype_name,
            device=str(self.device),
            max_num_seqs=settings.max_num_seqs,
            max_model_len=settings.max_model_len,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            attention_backend=args.attention_backend,
            enforce_eager=args.enforce_eager,
            seed=args.seed,
        )
        startup = time.perf_counter() - t0
        engine = self.llm.llm_engine
        graphs = engine.runner.cuda_graphs
        blocks = engine.kv_cache_manager.pool.num_blocks
        out: dict[str, Any] = {
            "startup_s": startup,
            "cuda_graph_capture_s": graphs.capture_time_s if graphs is not None else None,
            "cuda_graph_batch_sizes": graphs.batch_sizes if graphs is not None else None,
            "num_kv_blocks": blocks,
            "kv_cache_gib": blocks * engine.runner.kv_bytes_per_block / 2**30,
            "max_concurrency_at_max_model_len": blocks * engine.config.block_size / settings.max_model_len,
            "attention_backend": engine.runner.backend.name,
            "warmup_s": warm_up(self.llm, settings.shape.vocab_size, settings),
        }
        if self.wants("throughput"):
            out["engine"] = engine_run(self.llm, self.requests, args.temperature, trace_steps=True)
            # Once more: what the first run paid once (allocations, compilations) shows as a difference.
            self.llm.llm_engine.reset_prefix_cache()
            out["engine_again"] = engine_run(self.llm, self.requests, args.temperature, trace_steps=True)
            out["passed"] = out["engine"]["output_tokens"] == out["engine"]["expected_output_tokens"]
        return out

    def section_hf(self) -> dict[str, Any]:
        """The engine and then transformers on the same subsample of the workload."""
        settings = self.settings
        sub = self.requests[: settings.hf_requests]
        self.llm.llm_engine.reset_prefix_cache()
        ours = engine_run(self.llm, sub, self.args.temperature)
        self.llm = None  # frees the engine's KV cache and graphs for transformers
        free_device_memory(self.device)
        timeout = max(10.0, min(settings.hf_timeout_s, self.deadline.remaining - 30.0))
        assert self.model_dir is not None
        hf = run_hf_continuous_batching(
            self.model_dir,
            sub,
            self.device,
            self.dtype,
            self.args.temperature,
            settings.max_num_batched_tokens,
            timeout,
            self.args.seed,
        )
        return {
            "engine": ours,
            "hf": hf,
            "timeout_s": timeout,
            "speedup": ours["output_tokens_per_s"] / hf["output_tokens_per_s"]
            if hf["output_tokens_per_s"]
            else None,
            "full_workload_estimate_s": hf["elapsed_s"] * len(self.requests) / max(len(sub), 1),
            "note": f"transformers ran {len(sub)} of the {len(self.requests)} workload requests (the first "
            "ones) to bound its time; the engine ran the same subsample for the speedup. "
            "full_workload_estimate_s scales its time linearly to all requests.",
        }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    base = TINY if args.tiny else FULL
    settings = dataclasses.replace(base)
    overrides = {
        "num_requests": args.num_requests,
        "hf_requests": args.hf_requests,
        "hf_timeout_s": args.hf_timeout_s,
        "max_num_seqs": args.max_num_seqs,
        "decode_running": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    settings = dataclasses.replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    unknown = {s.strip() for s in args.skip.split(",") if s.strip()} - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections in --skip: {', '.join(sorted(unknown))}")
    if device.type == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    workdir = tempfile.mkdtemp(prefix="pagedllm-gpu-")
    run = Run(args, settings, device, workdir)
    results = run.results
    results["machine"] = machine_info(device)
    results["settings"] = {
        **{k: v for k, v in asdict(settings).items() if k != "shape"},
        "tiny": args.tiny,
        "dtype": run.dtype_name,
        "temperature": args.temperature,
        "seed": args.seed,
        "skipped_sections": sorted(run.skip),
    }
    try:
        run.run()
    finally:
        run.llm = None
        free_device_memory(device)
        shutil.rmtree(workdir, ignore_errors=True)

    sections = [results.get(s) for s in ("random_model", "equivalence_model", *SECTIONS)]
    errors = [s for s in sections if s is not None and s.get("status") == "error"]
    failed = [s for s in sections if s is not None and s.get("passed") is False]
    results["passed"] = not errors and not failed
    run.save(final=True)
    print(f"\nresults: {os.path.abspath(args.output_json)} ({run.deadline.elapsed:.0f}s)\n", flush=True)
    print(format_table(summary_rows(results)), flush=True)
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
