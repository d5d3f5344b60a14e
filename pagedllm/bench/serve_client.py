"""The load generator of ``pagedllm bench serve``: streamed ``/v1/completions`` requests sent to an
OpenAI-compatible server at gamma-renewal (Poisson by default) arrival times, at most
``max_concurrency`` in flight, and the timing of every chunk each request received (see
:mod:`pagedllm.bench.serve` for what is measured)."""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedllm.bench.workloads import BenchRequest


@dataclass
class RequestResult:
    """What the client saw of one streamed request (times in seconds, relative to the run's start)."""

    index: int
    prompt_len: int
    requested_output_len: int
    success: bool = False
    error: str = ""
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

    async def send(self, index: int, req: BenchRequest) -> RequestResult:
        result = RequestResult(index, req.prompt_len, req.output_len)
        body = {
            "model": self.model,
            "prompt": req.prompt_token_ids,
            "max_tokens": req.output_len,
            "temperature": self.temperature,
            "ignore_eos": self.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
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
) -> tuple[list[RequestResult], float, str]:
    """Send ``requests`` to the server; returns the per-request results, the run's duration and the
    model name used."""
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
            res = await warm.send(-1, BenchRequest(requests[0].prompt_token_ids[:16], 2))
            if not res.success:
                raise RuntimeError(f"the warm-up request failed: {res.error}")
        offsets = arrival_offsets(len(requests), request_rate, burstiness, seed)
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        t0 = time.perf_counter()
        sender = _Client(client, url, model_name, headers, temperature, ignore_eos, t0)

        async def one(i: int, req: BenchRequest) -> RequestResult:
            if semaphore is None:
                return await sender.send(i, req)
            async with semaphore:
                return await sender.send(i, req)

        tasks = []
        for i, (req, offset) in enumerate(zip(requests, offsets, strict=True)):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return list(results), duration, model_name
