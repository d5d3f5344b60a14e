"""``decode``: decode steps with ``decode_running`` requests running (final outputs only, as those of
``LLM.generate``): runs of consecutive steps without and with scheduling ahead
(``async_scheduling``), the synchronising CUDA calls inside a launch, and a step broken down into
input staging, forward (graph replay + logits), sampler and the rest, the device synchronised
around each."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pagedllm_bench.common import synchronize

from .common import Settings
from .probes import patched, sync_warnings


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
    step = statistics.fmean(timers["step"])
    device_work = forward + sample
    return {
        "num_running": num_running,
        "prompt_len": prompt_len,
        "cuda_graphs": graphs is not None,
        "async_scheduling_default": default_async,
        "prefill_s": prefill_s,
        "steps_measured": steps,
        "mean_context_tokens": statistics.fmean(contexts),
        "mean_context_per_request": statistics.fmean([c / max(num_running, 1) for c in contexts]),
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
