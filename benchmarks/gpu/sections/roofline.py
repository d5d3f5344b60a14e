"""``roofline``: the bytes a decode step must read (the weights once and the KV cache of every
running request) over the bandwidth of a large device copy, as a fraction of the measured forward
and step; and the whole workload's floor against the measured run.

The copy bandwidth and the matrix-product rate are timed by :mod:`pagedllm_bench.roofline` (best of
10 calls after 2 untimed, the device synchronised around each).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm_bench.common import free_device_memory
from pagedllm_bench.roofline import best_time, measure_bandwidth
from pagedllm_bench.workloads import BenchRequest

from .common import Settings

TIMED_CALLS = {"repeats": 10, "min_time_s": 0.0, "warmup": 2}


def copy_bandwidth(device: torch.device, nbytes: int) -> dict[str, Any]:
    """Bandwidth of a device-to-device copy of ``nbytes`` (bytes read + bytes written per second)."""
    bw = measure_bandwidth(nbytes >> 20, device=device, **TIMED_CALLS)
    free_device_memory(device)
    return bw


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """FLOP/s of an ``n`` x ``n`` x ``n`` matrix product on random data."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / best_time(lambda: torch.mm(a, b), device=device, **TIMED_CALLS)


def workload_roofline(
    requests: list[BenchRequest],
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
        (r.output_len - 1) * r.prompt_len + r.output_len * (r.output_len - 1) // 2 for r in requests
    )
    decode_s = (steps * weight_bytes + kv_tokens * kv_bytes_per_token) / bytes_per_s
    prefill_s = 2 * num_weights * sum(r.prompt_len for r in requests) / flops_per_s
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
    requests: list[BenchRequest],
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
        "copy_bytes": settings.copy_bytes,
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
