"""``serve``: the OpenAI server streaming ``/v1/completions`` of the first workload requests (outputs
capped), all at once, against ``LLM.generate`` on the same requests: output tokens per second of each.

The FastAPI app runs in this process with an in-process HTTP client (``httpx.ASGITransport``), so
the engine thread, the event loop and the client share the interpreter lock as they would in a
server process that also hosted its clients: a conservative measure of the server's own host cost.
``host_serve.py`` serves through the same app and client.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from pagedllm_bench.workloads import BenchRequest

from .throughput import engine_run


def bench_app(engine: Any) -> Any:
    """The OpenAI server's FastAPI app over ``engine``, serving it as the model ``bench``."""
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.engine.observe.metrics import EngineMetrics
    from pagedllm.entrypoints.openai.api_server import ServerSettings, build_app

    metrics = EngineMetrics("bench")
    return build_app(
        AsyncLLMEngine(engine, metrics=metrics, log_stats_interval=None),
        ServerSettings(served_model_names=["bench"]),
        metrics,
    )


@asynccontextmanager
async def in_process_client(app: Any) -> AsyncIterator[Any]:
    """An ``httpx.AsyncClient`` calling ``app`` in this process, inside the app's lifespan."""
    import httpx

    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench", timeout=600) as client:
            yield client


def section_serve(
    llm: Any, requests: list[BenchRequest], temperature: float, max_output: int
) -> dict[str, Any]:
    """The OpenAI server streaming completions of the same requests the engine then runs offline
    (the client reads raw bytes; only each stream's final usage event is parsed)."""
    import httpx

    reqs = [BenchRequest(r.prompt_token_ids, min(r.output_len, max_output)) for r in requests]
    engine = llm.llm_engine
    engine.reset_prefix_cache()
    offline = engine_run(llm, reqs, temperature)
    engine.reset_prefix_cache()
    app = bench_app(engine)

    async def one(client: httpx.AsyncClient, r: BenchRequest) -> int:
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
        async with in_process_client(app) as client:
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
