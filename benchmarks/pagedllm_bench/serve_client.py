"""The load generator of ``pagedllm bench serve``: streamed ``/v1/completions`` requests sent to an
OpenAI-compatible server at gamma-renewal (Poisson by default) arrival times, at most
``max_concurrency`` in flight, and the timing of every chunk each request received (see
:mod:`pagedllm_bench.serve` for what is measured).

Requests may carry a ``priority`` each, and a first wave (``saturate_first`` requests) may be sent
together before the others: the arrival process then starts once every request of the wave is
streaming, or one of them has ended (:mod:`pagedllm_bench.serve_priority` uses both)."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedllm_bench.workloads import BenchRequest


@dataclass
class RequestResult:
    """What the client saw of one streamed request (times in seconds, relative to the run's start)."""

    index: int
    prompt_len: int
    requested_output_len: int
    success: bool = False
    error: str = ""
    priority: int | None = None  # sent with the request (None: left out)
    start: float = 0.0
    ttft: float = math.nan
    latency: float = math.nan
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk, relative to the run
    chunk_tokens: list[int] = field(default_factory=list)  # cumulative output tokens after each chunk

    @property
    def tpot(self) -> float:
        if self.output_tokens < 2:
            return math.nan
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def arrival_offsets(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (seconds after the start) of ``n`` requests: a gamma renewal process of mean rate
    ``request_rate`` and shape ``burstiness`` (1 = Poisson); all zero for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


class _Client:
    """Sends streamed completion requests and records their timing."""

    def __init__(
        self,
        client: Any,
        url: str,
        model: str,
        headers: dict[str, str],
        temperature: float,
        ignore_eos: bool,
        t0: float,
    ) -> None:
        self.client = client
        self.url = url
        self.model = model
        self.headers = headers
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self.t0 = t0

    async def send(
        self,
        index: int,
        req: BenchRequest,
        priority: int | None = None,
        on_first_chunk: Callable[[], None] | None = None,
    ) -> RequestResult:
        result = RequestResult(index, req.prompt_len, req.output_len, priority=priority)
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": req.prompt_token_ids,
            "max_tokens": req.output_len,
            "temperature": self.temperature,
            "ignore_eos": self.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if priority is not None:
            body["priority"] = priority
        start = time.perf_counter()
        result.start = start - self.t0
        last = start
        chunks = 0
        try:
            async with self.client.post(self.url, json=body, headers=self.headers) as resp:
                if resp.status != 200:
                    text = (await resp.read()).decode(errors="replace")
                    result.error = f"HTTP {resp.status}: {text[:500]}"
                    return result
                async for raw in resp.content:
                    if not raw.startswith(b"data:"):
                        continue
                    now = time.perf_counter()
                    payload = raw[5:].strip()
                    if payload == b"[DONE]":
                        break
                    data = json.loads(payload)
                    if "error" in data:
                        result.error = str(data["error"])
                        return result
                    usage = data.get("usage") or {}
                    if data.get("choices"):
                        if chunks == 0:
                            result.ttft = now - start
                            if on_first_chunk is not None:
                                on_first_chunk()
                        else:
                            result.itl.append(now - last)
                        last = now
                        chunks += 1
                        count = usage.get("completion_tokens")
                        tokens = int(count) if count is not None else chunks
                        result.chunk_times.append(now - self.t0)
                        result.chunk_tokens.append(tokens)
                        result.output_tokens = tokens
                    elif usage.get("completion_tokens") is not None:
                        result.output_tokens = int(usage["completion_tokens"])
            result.latency = time.perf_counter() - start
            if chunks == 0:
                result.error = "the stream ended without any completion chunk."
            else:
                result.success = True
        except Exception as exc:  # noqa: BLE001 - a failed request is recorded, not fatal
            result.error = f"{type(exc).__name__}: {exc}"
        return result


async def _get_model_name(client: Any, base_url: str, headers: dict[str, str]) -> str:
    async with client.get(base_url + "/v1/models", headers=headers) as resp:
        resp.raise_for_status()
        data = (await resp.json()).get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model.")
    return str(data[0]["id"])


class _Wave:
    """The first wave of a run: ``done`` is set once each of its ``size`` requests streams, or once
    one of them has ended (a server that cannot run them all at once never has them all streaming)."""

    def __init__(self, size: int) -> None:
        self.left = size
        self.done = asyncio.Event()
        if size == 0:
            self.done.set()

    def streaming(self) -> None:
        self.left -= 1
        if self.left <= 0:
            self.done.set()

    def ended(self) -> None:
        self.done.set()


async def run_benchmark(
    base_url: str,
    requests: list[BenchRequest],
    *,
    model: str | None = None,
    api_key: str | None = None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    seed: int = 0,
    timeout_s: float = 600.0,
    warmup: bool = True,
    priorities: Sequence[int] | None = None,
    saturate_first: int = 0,
) -> tuple[list[RequestResult], float, str]:
    """Send ``requests`` to the server; returns the per-request results, the run's duration and the
    model name used.

    ``priorities`` (one per request) go in the request bodies, the warm-up request's too (with the
    first one's), so that a server refusing them fails before the run. The first ``saturate_first``
    requests are sent at once at the start; the others follow the arrival process, which starts once
    each of those is streaming or one of them has ended."""
    if priorities is not None and len(priorities) != len(requests):
        raise ValueError(f"{len(priorities)} priorities for {len(requests)} requests.")
    if not 0 <= saturate_first <= len(requests):
        raise ValueError(f"saturate_first must be within 0..{len(requests)}, got {saturate_first}.")
    import aiohttp

    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    conns = max(len(requests), max_concurrency or 0, 1)
    connector = aiohttp.TCPConnector(limit=conns)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    # aiohttp (as vLLM's serving benchmark uses) reads a stream's lines at a fraction of httpx's
    # CPU cost; the client shares the machine with the server it measures.
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        model_name = model or await _get_model_name(client, base_url, headers)
        url = base_url + "/v1/completions"
        if warmup:
            warm = _Client(client, url, model_name, headers, 0.0, True, time.perf_counter())
            warm_priority = priorities[0] if priorities else None
            res = await warm.send(-1, BenchRequest(requests[0].prompt_token_ids[:16], 2), warm_priority)
            if not res.success:
                raise RuntimeError(f"the warm-up request failed: {res.error}")
        offsets = arrival_offsets(len(requests) - saturate_first, request_rate, burstiness, seed)
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        wave = _Wave(saturate_first)
        t0 = time.perf_counter()
        sender = _Client(client, url, model_name, headers, temperature, ignore_eos, t0)

        async def one(i: int, req: BenchRequest) -> RequestResult:
            priority = priorities[i] if priorities is not None else None
            in_wave = i < saturate_first
            try:
                if semaphore is None:
                    return await sender.send(i, req, priority, wave.streaming if in_wave else None)
                async with semaphore:
                    return await sender.send(i, req, priority, wave.streaming if in_wave else None)
            finally:
                if in_wave:
                    wave.ended()

        tasks = [asyncio.create_task(one(i, requests[i])) for i in range(saturate_first)]
        await wave.done.wait()
        start = time.perf_counter() if saturate_first else t0
        rest = range(saturate_first, len(requests))
        for i, offset in zip(rest, offsets, strict=True):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, requests[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return list(results), duration, model_name
