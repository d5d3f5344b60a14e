"""``throughput``: start-up of the engine on the random-weight model (weights, memory profiling, KV
cache, graph capture), then the whole workload through ``LLM.generate`` twice (a difference between
the runs is what the first paid once), each with its steps' times by number of running requests
(the prefill phase apart), its slowest steps and its garbage collections."""

from __future__ import annotations

import contextlib
import gc
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pagedllm_bench.common import free_device_memory, synchronize
from pagedllm_bench.workloads import BenchRequest

from .common import RunState, Settings
from .probes import patched

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
        "ms_per_step": 1e3 * statistics.fmean(times),
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
    llm: Any, requests: list[BenchRequest], temperature: float, trace_steps: bool = False
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


def section_throughput(state: RunState, measure: bool) -> dict[str, Any]:
    """Start the engine (timed; ``state.llm`` holds it from then on, for the later sections), warm it
    up, then, when ``measure``, run the whole workload twice."""
    from pagedllm import LLM

    settings, args = state.settings, state.args
    free_device_memory(state.device)
    t0 = time.perf_counter()
    state.llm = LLM(
        state.model_dir,
        dtype=state.dtype_name,
        device=str(state.device),
        max_num_seqs=settings.max_num_seqs,
        max_model_len=settings.max_model_len,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
    )
    startup = time.perf_counter() - t0
    engine = state.llm.llm_engine
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
        "warmup_s": warm_up(state.llm, settings.shape.vocab_size, settings),
    }
    if measure:
        out["engine"] = engine_run(state.llm, state.requests, args.temperature, trace_steps=True)
        # Once more: what the first run paid once (allocations, compilations) shows as a difference.
        engine.reset_prefix_cache()
        out["engine_again"] = engine_run(state.llm, state.requests, args.temperature, trace_steps=True)
        out["passed"] = out["engine"]["output_tokens"] == out["engine"]["expected_output_tokens"]
    return out
