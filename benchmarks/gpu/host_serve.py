#!/usr/bin/env python
"""Host work of the OpenAI server per decode step at 256 running requests, measured without a GPU.

As in ``host_step.py``, the engine takes the GPU's decode path with a CUDA-graph replay that returns
fixed logits instead of running the model, so what a step costs is host work: the engine's
(scheduling, staging, sampling calls, output processing) and, when serving, the async front end's
and the event loop's (handing outputs over, building and sending chunks). Both run in one process
and share the interpreter lock, so on a GPU their sum is what the device would wait for.

Four phases of ``--requests`` requests of ``--max-tokens`` tokens each (greedy, EOS ignored):

* the engine alone, cumulative outputs and final-only outputs (``engine.step()`` in a loop);
* the FastAPI app serving chat completions, streamed and not, to an in-process HTTP client
  (``httpx.ASGITransport``; the client's parsing of the chunks counts as other-thread time too).

Per phase, over the steady decode steps: wall ms per step, the sampler's share (its tensor work runs
on the device on a GPU; torch uses one thread here so it stays comparable), host ms per step
(step less the sampler), and the CPU time of the engine thread and of the rest of the process.

    python benchmarks/gpu/host_serve.py [--requests 256] [--max-tokens 120]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from typing import Any

import httpx
import torch
from host_step import attach_stub_graphs
from sections.serve import bench_app, in_process_client  # (puts the repository on sys.path)

from pagedllm import LLM, RequestOutputKind, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm_bench.common import write_json


class StepClock:
    """Wraps ``engine.step``: per step, wall time, sampler time, engine-thread CPU time, and the
    process CPU time and clock when the step ended."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.records: list[tuple[float, float, float, float, float]] = []
        step = engine.step

        def timed_step() -> Any:
            sample_before = engine.step_times.sample
            wall, cpu = time.perf_counter(), time.thread_time()
            out = step()
            end = time.perf_counter()
            self.records.append(
                (
                    end - wall,
                    engine.step_times.sample - sample_before,
                    time.thread_time() - cpu,
                    time.process_time(),
                    end,
                )
            )
            return out

        engine.step = timed_step  # type: ignore[method-assign]

    def steady(self, skip: int) -> dict[str, float]:
        """Means per step over the steps after the first ``skip`` (prefill and ramp-up), less the last
        few (requests finishing)."""
        records = self.records[skip:-5]
        self.records = []
        n = len(records) - 1
        if n < 1:
            raise RuntimeError("too few steps to measure; raise --max-tokens")
        wall = (records[-1][4] - records[0][4]) / n
        process_cpu = (records[-1][3] - records[0][3]) / n
        engine_cpu = sum(r[2] for r in records[1:]) / n
        sampler = sum(r[1] for r in records[1:]) / n
        return {
            "steps": n,
            "wall_ms": 1e3 * wall,
            "sampler_ms": 1e3 * sampler,
            "host_ms": 1e3 * (wall - sampler),
            "engine_thread_cpu_ms": 1e3 * engine_cpu,
            "other_cpu_ms": 1e3 * (process_cpu - engine_cpu),
        }


def engine_alone(
    engine: LLMEngine, n: int, max_tokens: int, kind: RequestOutputKind, rng: random.Random
) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind)
    for i in range(n):
        engine.add_request(f"{kind.name}-{i}", [rng.randrange(100, 20000) for _ in range(8)], params)
    while engine.has_unfinished_requests():
        engine.step()


async def serve(client: httpx.AsyncClient, n: int, max_tokens: int, stream: bool) -> int:
    """``n`` concurrent chat completions through the app; returns the number of events received."""

    async def one(i: int) -> int:
        body = {
            "model": "bench",
            "messages": [{"role": "user", "content": f"Item {i}"}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }
        if not stream:
            r = await client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            return 1
        events = 0
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                events += line.startswith("data: ")
        return events

    return sum(await asyncio.gather(*(one(i) for i in range(n))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    n = args.requests
    max_model_len = 1024
    llm = LLM(
        max_num_seqs=n,
        max_model_len=max_model_len,
        max_num_batched_tokens=max(2048, n * 8),
        num_kv_blocks=n * (max_model_len // 16) + 16,
        enforce_eager=True,
    )
    engine = llm.llm_engine
    attach_stub_graphs(engine, n, args.seed)
    clock = StepClock(engine)
    rng = random.Random(args.seed)
    skip = 10
    results: dict[str, Any] = {"requests": n, "max_tokens": args.max_tokens}
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
        engine_alone(engine, n, args.max_tokens, kind, rng)
        results[f"engine_{kind.name.lower()}"] = clock.steady(skip)

    app = bench_app(engine)

    async def run_server() -> None:
        async with in_process_client(app) as client:
            for stream in (True, False):
                events = await serve(client, n, args.max_tokens, stream)
                name = "server_stream" if stream else "server_no_stream"
                results[name] = {**clock.steady(skip), "events": events}

    asyncio.run(run_server())
    engine.check_idle()

    print(f"\nHost work per decode step, {n} running requests, CUDA-graph staging, model not run")
    print("phase | wall ms | sampler ms | host ms (wall - sampler) | engine thread cpu ms | other cpu ms")
    for name in ("engine_cumulative", "engine_final_only", "server_stream", "server_no_stream"):
        r = results[name]
        print(
            f"{name} | {r['wall_ms']:.2f} | {r['sampler_ms']:.2f} | {r['host_ms']:.2f} | "
            f"{r['engine_thread_cpu_ms']:.2f} | {r['other_cpu_ms']:.2f}"
        )
    if args.output_json:
        write_json(args.output_json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
