"""``hf``: transformers' continuous batching (the manager behind ``generate_batch``, through
:mod:`pagedllm_bench.baselines`, with per-request ``max_new_tokens`` and EOS disabled) on the first
``hf_requests`` requests of the workload, time-bounded, and the engine on those same requests."""

from __future__ import annotations

import time
from typing import Any

import torch

from pagedllm_bench.baselines import (
    cb_config,
    generation_config,
    has_cb_manager,
    load_hf_model,
    run_continuous_batching,
)
from pagedllm_bench.common import free_device_memory, synchronize
from pagedllm_bench.workloads import BenchRequest

from .common import RunState
from .throughput import engine_run


# Not inference_mode: transformers' continuous batching updates its cache in place from a thread of
# its own, which (in some transformers 5 releases) is not in inference mode, so its tensors must not
# be inference tensors.
@torch.no_grad()
def run_hf_continuous_batching(
    model_dir: str,
    requests: list[BenchRequest],
    device: torch.device,
    dtype: torch.dtype,
    temperature: float,
    max_batch_tokens: int,
    timeout_s: float,
    seed: int,
) -> dict[str, Any]:
    """The requests through transformers' continuous batching manager (transformers 5), stopped
    after ``timeout_s`` (then only the completed requests count), or through ``generate_batch``
    where transformers has no such manager."""
    t0 = time.perf_counter()
    model: Any = load_hf_model(model_dir, device, dtype, attn_implementation="sdpa")
    load_s = time.perf_counter() - t0
    try:
        if has_cb_manager():
            out = _hf_manager_run(model, requests, device, temperature, max_batch_tokens, timeout_s, seed)
        else:
            out = _hf_generate_batch_run(model, requests, device, temperature, max_batch_tokens)
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
    requests: list[BenchRequest],
    device: torch.device,
    temperature: float,
    max_batch_tokens: int,
    timeout_s: float,
    seed: int,
) -> dict[str, Any]:
    """Each request with its own ``max_new_tokens``; EOS is disabled; the KV cache holds every
    request at once. Failed requests are listed; it fails only when all of them did."""
    gen_config = generation_config(max(r.output_len for r in requests), temperature, [], 0, True)
    run = run_continuous_batching(
        model,
        requests,
        gen_config,
        cb_config(requests, max_batch_tokens, seed),
        timeout_s=timeout_s,
        device=device,
    )
    results = run.results
    errors = [r.error for r in results.values() if r.error is not None]
    if results and len(errors) == len(results):
        raise RuntimeError(f"every request failed in transformers' continuous batching: {errors[0]}")
    return {
        "api": "continuous_batching_context_manager + add_request (per-request max_new_tokens)",
        "completed_requests": len(results),
        "timed_out": run.timed_out,
        "errors": errors[:3],
        "output_tokens": sum(len(r.generated_tokens) for r in results.values()),
        "elapsed_s": run.elapsed_s,
        "startup_s": run.startup_s,
        "note": "completed requests only (time limit reached)" if run.timed_out else "all requests completed",
    }


def _hf_generate_batch_run(
    model: Any,
    requests: list[BenchRequest],
    device: torch.device,
    temperature: float,
    max_batch_tokens: int,
) -> dict[str, Any]:
    """``model.generate_batch`` (transformers 4.5x): one ``max_new_tokens`` for all requests, so every
    request generates the longest output; only the tokens each request asked for are counted."""
    gen_config = generation_config(
        max(r.output_len for r in requests), temperature, [], 0, True, max_batch_tokens=max_batch_tokens
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


def section_hf(state: RunState) -> dict[str, Any]:
    """The engine and then transformers on the same subsample of the workload; the engine is let go
    (``state.llm`` becomes None) in between, so that transformers has the device's memory."""
    settings, args = state.settings, state.args
    sub = state.requests[: settings.hf_requests]
    state.llm.llm_engine.reset_prefix_cache()
    ours = engine_run(state.llm, sub, args.temperature)
    state.llm = None  # frees the engine's KV cache and graphs for transformers
    free_device_memory(state.device)
    timeout = max(10.0, min(settings.hf_timeout_s, state.deadline.remaining - 30.0))
    assert state.model_dir is not None
    hf = run_hf_continuous_batching(
        state.model_dir,
        sub,
        state.device,
        state.dtype,
        args.temperature,
        settings.max_num_batched_tokens,
        timeout,
        args.seed,
    )
    return {
        "engine": ours,
        "hf": hf,
        "timeout_s": timeout,
        "speedup": ours["output_tokens_per_s"] / hf["output_tokens_per_s"]
        if hf["output_tokens_per_s"]
        else None,
        "full_workload_estimate_s": hf["elapsed_s"] * len(state.requests) / max(len(sub), 1),
        "note": f"transformers ran {len(sub)} of the {len(state.requests)} workload requests (the first "
        "ones) to bound its time; the engine ran the same subsample for the speedup. "
        "full_workload_estimate_s scales its time linearly to all requests.",
    }
