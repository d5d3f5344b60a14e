#!/usr/bin/env python
"""Times the paged-attention kernel's decode launch over a grid of tilings, on the batches that
dominate the throughput workload (Qwen3-0.6B's attention shape, bf16, 16-token blocks).

Each batch's caches are random, with shuffled physical blocks (the test suite's paged batches,
``tests/helpers/attention_cases.py``, moved to the device); every tiling's output
is compared with the default tiling's (a broken tiling shows as a large difference), and its time is
turned into the bandwidth of the K/V bytes it must read. The default tiling
(:func:`pagedllm.kernels.triton.attention.choose_config`) is marked. A device-to-device copy gives
the bandwidth to compare with.

    python benchmarks/gpu/tune_attention.py --output-json tune_attention.json

``--tiny --device cpu`` (with ``TRITON_INTERPRET=1``) runs two small tilings on a small batch.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from sections.common import write_results  # (puts the repository and its test helpers on sys.path)
from sections.kernels import on_device
from sections.roofline import copy_bandwidth

from helpers.attention_cases import Batch
from pagedllm.kernels.triton.attention import AttentionLaunchConfig, choose_config, paged_attention


@dataclass
class DecodeBatch:
    """Decode rows (one query token each) over random paged caches."""

    name: str
    seq_lens: list[int]
    num_kv_heads: int = 8
    group: int = 2
    head_dim: int = 128
    block_size: int = 16


def workload_batches(tiny: bool, seed: int) -> list[DecodeBatch]:
    rng = random.Random(seed)
    if tiny:
        return [DecodeBatch("tiny", [rng.randint(1, 80) for _ in range(4)], 2, 2, 32)]
    # Mid-run of the throughput workload: 256 running, prompts of 100-1024 plus what was generated.
    full = [rng.randint(100, 1024) + rng.randint(0, 600) for _ in range(256)]
    # Its tail: fewer requests, longer contexts.
    tail = [rng.randint(100, 1024) + rng.randint(600, 1000) for _ in range(48)]
    return [DecodeBatch("256 running", full), DecodeBatch("48 running (tail)", tail)]


def build(batch: DecodeBatch, device: torch.device, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    paged = Batch(
        [(1, s) for s in batch.seq_lens],
        block_size=batch.block_size,
        num_kv_heads=batch.num_kv_heads,
        group=batch.group,
        head_dim=batch.head_dim,
        dtype=dtype,
        seed=seed,
    )
    query, k_cache, v_cache, meta = on_device(paged, device)
    kv_bytes = 2 * sum(batch.seq_lens) * batch.num_kv_heads * batch.head_dim * k_cache.element_size()
    return {"query": query, "k": k_cache, "v": v_cache, "meta": meta, "kv_bytes": kv_bytes}


def time_ms(fn: Any, device: torch.device, reps: int) -> float:
    """Median of ``reps`` timed calls (CUDA events on a GPU, wall clock elsewhere), after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
    times.sort()
    return times[len(times) // 2]


def tilings(tiny: bool, num_seqs: int) -> list[AttentionLaunchConfig]:
    if tiny:
        return [AttentionLaunchConfig(16, 16, 1), AttentionLaunchConfig(16, 32, 2, num_warps=2, num_stages=1)]
    splits = (1, 2) if num_seqs >= 128 else (1, 2, 4)
    grid = itertools.product((32, 64, 128), (4, 8), (2, 3, 4), splits)
    return [AttentionLaunchConfig(16, t, s, num_warps=w, num_stages=st) for t, w, st, s in grid]


def sweep(
    batch: DecodeBatch, device: torch.device, dtype: torch.dtype, tiny: bool, reps: int
) -> dict[str, Any]:
    data = build(batch, device, dtype, seed=0)
    q, k, v, meta = data["query"], data["k"], data["v"], data["meta"]
    scale = batch.head_dim**-0.5
    default = choose_config(q, k, meta)
    expected = paged_attention(q, k, v, meta, scale, config=default).float()
    rows = []
    for cfg in tilings(tiny, len(batch.seq_lens)):
        try:
            out = paged_attention(q, k, v, meta, scale, config=cfg)
            diff = float((out.float() - expected).abs().max())
            ms = time_ms(lambda cfg=cfg: paged_attention(q, k, v, meta, scale, config=cfg), device, reps)
            rows.append({**asdict(cfg), "ms": ms, "GBps": data["kv_bytes"] / ms / 1e6, "max_diff": diff})
        except Exception as exc:  # noqa: BLE001 - a tiling that fails to compile is reported, not fatal
            rows.append({**asdict(cfg), "error": f"{type(exc).__name__}: {exc}"[:300]})
    timed = [r for r in rows if "ms" in r]
    default_ms = time_ms(lambda: paged_attention(q, k, v, meta, scale, config=default), device, reps)
    best = min(timed, key=lambda r: r["ms"]) if timed else None
    return {
        "batch": batch.name,
        "num_seqs": len(batch.seq_lens),
        "mean_seq_len": sum(batch.seq_lens) / len(batch.seq_lens),
        "kv_bytes": data["kv_bytes"],
        "default": {**asdict(default), "ms": default_ms, "GBps": data["kv_bytes"] / default_ms / 1e6},
        "best": best,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--output-json", default="tune_attention.json")
    args = p.parse_args(argv)
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    results: dict[str, Any] = {"device": str(device), "dtype": str(dtype)}
    if device.type == "cuda":
        results["copy_GBps"] = copy_bandwidth(device, 1 << 30)["bytes_per_s"] / 1e9
    results["batches"] = [
        sweep(b, device, dtype, args.tiny, args.reps) for b in workload_batches(args.tiny, 0)
    ]
    results["seconds"] = time.perf_counter() - t0
    write_results(args.output_json, "tune_attention.json", results)
    print(f"copy bandwidth: {results.get('copy_GBps', float('nan')):,.0f} GB/s")
    for b in results["batches"]:
        d = b["default"]
        print(
            f"\n{b['batch']}: {b['num_seqs']} seqs, mean context {b['mean_seq_len']:.0f}, KV {b['kv_bytes'] / 1e9:.2f} GB"
        )
        print(
            f"  default tile_n={d['tile_n']} splits={d['num_splits']} warps={d['num_warps']} stages={d['num_stages']}: {d['ms']:.3f} ms, {d['GBps']:,.0f} GB/s"
        )
        timed = sorted((r for r in b["rows"] if "ms" in r), key=lambda r: r["ms"])
        for r in timed[:8]:
            print(
                f"  tile_n={r['tile_n']:>3} splits={r['num_splits']} warps={r['num_warps']} stages={r['num_stages']}: {r['ms']:.3f} ms, {r['GBps']:,.0f} GB/s, max diff {r['max_diff']:.2e}"
            )
        for r in b["rows"]:
            if "error" in r:
                print(
                    f"  FAILED tile_n={r['tile_n']} splits={r['num_splits']} warps={r['num_warps']} stages={r['num_stages']}: {r['error']}"
                )
    print(f"\n({results['seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
