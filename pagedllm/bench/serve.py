"""``pagedllm bench serve``: an online benchmark against a running OpenAI-compatible server.

Requests of the random workload are sent to ``/v1/completions`` as token-id prompts with
``stream: true`` (``ignore_eos`` and per-request ``max_tokens``, greedy unless ``--temperature``).
Arrivals follow a Poisson process of ``--request-rate`` requests/s (``inf``: all at once); with
``--burstiness`` other than 1 the inter-arrival times are gamma-distributed with that shape and the
same mean. ``--max-concurrency`` caps the requests in flight (clients wait for a free slot).

Per request, measured on the client: TTFT (time to the first streamed chunk), ITL (time between
successive chunks), TPOT (``(latency - TTFT) / (output tokens - 1)``) and end-to-end latency. Output
token counts come from the server's usage statistics (``stream_options.include_usage`` with
``continuous_usage_stats``, so every chunk carries the running count); a chunk may hold several tokens
when they only decode to text together.

``--compare-offline`` then runs the same requests through ``LLM.generate`` in this process, with the
engine arguments given here (they should match the server's; ``max_num_seqs`` is capped at
``--max-concurrency`` so both batch alike), and reports the server's throughput as a percentage of
the offline one.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedllm.bench.common import (
    distribution,
    format_table,
    machine_info,
    now_iso,
    peak_rss_mib,
    ratio,
    set_num_threads,
    write_json,
)
from pagedllm.bench.workloads import BenchRequest, Workload, add_workload_args, build_workload
from pagedllm.config import EngineConfig

logger = logging.getLogger("pagedllm.bench")

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "itl", "e2el")


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


def parse_slo(text: str | None) -> dict[str, float]:
    """``"ttft:500,tpot:50"`` (milliseconds) -> ``{"ttft": 0.5, "tpot": 0.05}`` (seconds)."""
    if not text:
        return {}
    slo: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(
                f"--slo entries must be METRIC:MS with METRIC in {', '.join(SLO_METRICS)}; got {part!r}."
            )
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--slo {name}: {value!r} is not a number of milliseconds.") from None
        if ms <= 0:
            raise ValueError(f"--slo {name} must be positive, got {value}.")
        slo[name] = ms / 1000.0
    return slo


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
            async with self.client.stream("POST", self.url, json=body, headers=self.headers) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    result.error = f"HTTP {resp.status_code}: {text[:500]}"
                    return result
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    now = time.perf_counter()
                    payload = line[5:].strip()
                    if payload == "[DONE]":
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
    resp = await client.get(base_url + "/v1/models", headers=headers)
    resp.raise_for_status()
    data = resp.json().get("data") or []
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
    import httpx

    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    conns = max(len(requests), max_concurrency or 0, 1)
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
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


def summarize(results: list[RequestResult], duration: float, slo: dict[str, float]) -> dict[str, Any]:
    """Aggregate metrics of a run: throughput, latency distributions (ms) and goodput."""
    ok = [r for r in results if r.success]
    duration = max(duration, 1e-9)
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)

    def ms(values: list[float]) -> dict[str, float]:
        return {k: v * 1e3 for k, v in distribution(values, PERCENTILES).items()}

    ttft = [r.ttft for r in ok]
    tpot = [r.tpot for r in ok if not math.isnan(r.tpot)]
    itl = [x for r in ok for x in r.itl]
    e2el = [r.latency for r in ok]
    good = 0
    for r in ok:
        values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency, "itl": max(r.itl, default=0.0)}
        if all(not (values[k] > limit) for k, limit in slo.items()):
            good += 1
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:10],
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "requested_output_tokens": sum(r.requested_output_len for r in ok),
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": ms(ttft),
        "tpot_ms": ms(tpot),
        "itl_ms": ms(itl),
        "e2el_ms": ms(e2el),
        "slo_ms": {k: v * 1e3 for k, v in slo.items()},
        "good_requests": good if slo else None,
        "goodput": good / duration if slo else None,
    }


def token_timeline(results: list[RequestResult], duration: float, bin_s: float) -> dict[str, Any]:
    """Output tokens/s and the mean number of requests in flight in each ``bin_s``-second bin."""
    nbins = max(1, math.ceil(duration / bin_s))
    tokens = np.zeros(nbins)
    in_flight = np.zeros(nbins)
    for r in results:
        prev = 0
        for t, cum in zip(r.chunk_times, r.chunk_tokens, strict=True):
            tokens[min(int(t / bin_s), nbins - 1)] += cum - prev
            prev = cum
        if r.success:
            # Time-weighted: the fraction of each bin the request spent in flight.
            end = r.start + r.latency
            for b in range(int(r.start / bin_s), min(int(end / bin_s), nbins - 1) + 1):
                overlap = min(end, (b + 1) * bin_s) - max(r.start, b * bin_s)
                in_flight[b] += max(0.0, overlap) / bin_s
    return {
        "bin_s": bin_s,
        "time_s": [(i + 0.5) * bin_s for i in range(nbins)],
        "output_tokens_per_s": list(tokens / bin_s),
        "requests_in_flight": list(in_flight),
    }


def write_plots(
    results: list[RequestResult], timeline: dict[str, Any], plot_dir: str, title: str
) -> list[str]:
    """Latency CDFs and output tokens/s over time as PNG files in ``plot_dir``; returns their paths."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(plot_dir, exist_ok=True)
    ok = [r for r in results if r.success]
    series = {
        "TTFT": [r.ttft * 1e3 for r in ok],
        "TPOT": [r.tpot * 1e3 for r in ok if not math.isnan(r.tpot)],
        "ITL": [x * 1e3 for r in ok for x in r.itl],
        "End-to-end latency": [r.latency * 1e3 for r in ok],
    }
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, values) in zip(axes.flat, series.items(), strict=True):
        if values:
            xs = np.sort(np.asarray(values))
            ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post")
            for p in PERCENTILES:
                ax.axvline(float(np.percentile(xs, p)), linestyle=":", linewidth=0.8, color="gray")
        ax.set_title(name)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of chunks")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Latency CDFs: {title}")
    fig.tight_layout()
    cdf_path = os.path.join(plot_dir, "latency_cdf.png")
    fig.savefig(cdf_path, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.plot(
        timeline["time_s"], timeline["output_tokens_per_s"], drawstyle="steps-mid", label="output tokens/s"
    )
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(
        timeline["time_s"],
        timeline["requests_in_flight"],
        drawstyle="steps-mid",
        color="tab:orange",
        alpha=0.7,
        label="requests in flight (mean over the bin)",
    )
    ax2.set_ylabel("requests in flight")
    ax2.set_ylim(bottom=0)
    ax.set_title(f"Throughput over time: {title}")
    lines = ax.get_lines() + ax2.get_lines()
    ax.legend(lines, [str(line.get_label()) for line in lines], loc="lower right", fontsize="small")
    fig.tight_layout()
    tps_path = os.path.join(plot_dir, "throughput_over_time.png")
    fig.savefig(tps_path, dpi=100)
    plt.close(fig)
    return [cdf_path, tps_path]


def run_offline(
    config: EngineConfig, workload: Workload, temperature: float, ignore_eos: bool
) -> dict[str, Any]:
    """The same requests through ``LLM.generate`` in this process; throughput of that run."""
    from pagedllm import LLM, SamplingParams

    engine_args = {k: v for k, v in dataclasses.asdict(config).items() if k != "model"}
    llm = LLM(config.model, **engine_args)
    llm.generate(
        [[11, 12, 13, 14, 15, 16, 17, 18]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False
    )
    llm.llm_engine.reset_prefix_cache()
    prompts: list[str | list[int]] = [r.prompt_token_ids for r in workload.requests]
    params = [
        SamplingParams(temperature=temperature, max_tokens=r.output_len, ignore_eos=ignore_eos)
        for r in workload.requests
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    n_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    del llm
    gc.collect()
    return {
        "elapsed_s": elapsed,
        "max_num_seqs": config.max_num_seqs,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(outputs) / elapsed,
        "output_throughput": n_out / elapsed,
        "total_token_throughput": (n_in + n_out) / elapsed,
    }


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="Server URL (default http://127.0.0.1:8000)."
    )
    parser.add_argument("--api-key", default=None, help="Bearer token for the server, if it needs one.")
    parser.add_argument(
        "--model-name",
        default=None,
        help="Model name to send (default: the first model listed by the server's /v1/models).",
    )
    add_workload_args(parser, prefix=False, dataset=False)
    group = parser.add_argument_group("load")
    group.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Mean arrival rate in requests/s (default inf: all requests at once).",
    )
    group.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="Gamma shape of the inter-arrival times: 1 is Poisson, below 1 burstier (default 1).",
    )
    group.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="Most requests in flight at once (default: no limit).",
    )
    group.add_argument(
        "--temperature", type=float, default=0.0, help="Sampling temperature (default 0: greedy)."
    )
    group.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Generate exactly each request's output length (default on).",
    )
    group.add_argument(
        "--slo",
        default=None,
        metavar="ttft:MS,tpot:MS",
        help="Service-level objectives for goodput (ttft, tpot, itl, e2el in milliseconds).",
    )
    group.add_argument(
        "--timeout", type=float, default=600.0, help="Per-request timeout in seconds (default 600)."
    )
    group.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Send one short untimed request first (default on).",
    )
    group = parser.add_argument_group("output")
    group.add_argument("--output-json", default=None, help="Write the results to this JSON file.")
    group.add_argument("--plot-dir", default=None, help="Write latency CDF and throughput PNG plots here.")
    group.add_argument(
        "--save-requests",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Include per-request timings in the JSON (default on).",
    )
    group = parser.add_argument_group("offline comparison")
    group.add_argument(
        "--compare-offline",
        action="store_true",
        help="Afterwards, run the same requests through LLM.generate here and compare throughput.",
    )
    group.add_argument(
        "--num-threads", type=int, default=None, help="torch threads of the offline run (default: torch's)."
    )
    engine_group = parser.add_argument_group("engine (the workload's tokenizer; the offline comparison)")
    EngineConfig.add_cli_args(engine_group)  # type: ignore[arg-type]


def _check_args(args: argparse.Namespace) -> None:
    if args.request_rate <= 0 or math.isnan(args.request_rate):
        raise ValueError(f"--request-rate must be positive, got {args.request_rate}.")
    if args.burstiness <= 0:
        raise ValueError(f"--burstiness must be positive, got {args.burstiness}.")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}.")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be non-negative, got {args.temperature}.")


def _workload(args: argparse.Namespace) -> Workload:
    from pagedllm.model.loader import resolve_model_path
    from pagedllm.model.tokenizer import load_tokenizer

    kind, path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(args.tokenizer or path)
    exclude = {t for t in (tokenizer.eos_token_id, tokenizer.bos_token_id) if t is not None}
    return build_workload(args, len(tokenizer), tokenizer, exclude)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        _check_args(args)
        slo = parse_slo(args.slo)
        set_num_threads(args.num_threads)
        config = EngineConfig.from_cli_args(args)
        workload = _workload(args)
    except (ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 2
    print(
        f"Workload: {len(workload.requests)} requests, {workload.num_prompt_tokens} prompt tokens, "
        f"{workload.num_output_tokens} output tokens; rate {args.request_rate} req/s, "
        f"max concurrency {args.max_concurrency or 'unlimited'}"
    )
    try:
        results, duration, model_name = asyncio.run(
            run_benchmark(
                args.base_url,
                workload.requests,
                model=args.model_name or config.served_model_name,
                api_key=args.api_key,
                request_rate=args.request_rate,
                burstiness=args.burstiness,
                max_concurrency=args.max_concurrency,
                temperature=args.temperature,
                ignore_eos=args.ignore_eos,
                seed=args.seed,
                timeout_s=args.timeout,
                warmup=args.warmup,
            )
        )
    except Exception as exc:  # noqa: BLE001 - e.g. the server is not reachable
        logger.error("Benchmark against %s failed: %s", args.base_url, exc)
        return 1
    metrics = summarize(results, duration, slo)
    bin_s = max(0.25, round(duration / 60, 2))
    timeline = token_timeline(results, duration, bin_s)

    offline: dict[str, Any] | None = None
    if args.compare_offline:
        offline_config = config
        if args.max_concurrency is not None and args.max_concurrency < config.max_num_seqs:
            offline_config = dataclasses.replace(config, max_num_seqs=args.max_concurrency)
        offline = run_offline(offline_config, workload, args.temperature, args.ignore_eos)
        offline["server_output_throughput_pct"] = _pct(
            metrics["output_throughput"], offline["output_throughput"]
        )
        offline["server_total_token_throughput_pct"] = _pct(
            metrics["total_token_throughput"], offline["total_token_throughput"]
        )

    plots: list[str] = []
    if args.plot_dir:
        title = (
            f"{len(workload.requests)} requests, rate {args.request_rate}, concurrency {args.max_concurrency}"
        )
        plots = write_plots(results, timeline, args.plot_dir, title)

    _print_report(metrics, offline, plots)
    if args.output_json:
        data: dict[str, Any] = {
            "benchmark": "serve",
            "date": now_iso(),
            "base_url": args.base_url,
            "model": model_name,
            "machine": machine_info(),
            "peak_rss_mib": peak_rss_mib(),
            "workload": workload.summary(),
            "load": {
                "request_rate": args.request_rate,
                "burstiness": args.burstiness,
                "max_concurrency": args.max_concurrency,
                "temperature": args.temperature,
                "ignore_eos": args.ignore_eos,
            },
            **metrics,
            "timeline": timeline,
            "offline": offline,
            "engine_config": dataclasses.asdict(config) if args.compare_offline else None,
            "plots": plots,
        }
        if args.save_requests:
            data["requests"] = [
                {
                    "index": r.index,
                    "success": r.success,
                    "error": r.error or None,
                    "prompt_len": r.prompt_len,
                    "requested_output_len": r.requested_output_len,
                    "output_tokens": r.output_tokens,
                    "start_s": r.start,
                    "ttft_s": r.ttft,
                    "tpot_s": r.tpot,
                    "e2el_s": r.latency,
                    "num_chunks": len(r.chunk_times),
                }
                for r in results
            ]
        write_json(args.output_json, data)
        print(f"\nWrote {args.output_json}")
    return 0 if metrics["completed"] else 1


def _pct(a: float, b: float) -> float | None:
    r = ratio(a, b)
    return None if r is None else 100.0 * r


def _print_report(metrics: dict[str, Any], offline: dict[str, Any] | None, plots: list[str]) -> None:
    print()
    print(
        f"Completed {metrics['completed']} requests ({metrics['failed']} failed) in {metrics['duration_s']:.2f} s"
    )
    for err in metrics["errors"]:
        print(f"  error: {err}")
    print(
        f"Request throughput {metrics['request_throughput']:.2f} req/s, output {metrics['output_throughput']:.1f} "
        f"tok/s, total {metrics['total_token_throughput']:.1f} tok/s"
    )
    if metrics["goodput"] is not None:
        print(f"Goodput {metrics['goodput']:.2f} req/s ({metrics['good_requests']} requests within the SLO)")
    rows = []
    for key, name in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2el_ms", "E2E latency"),
    ):
        d = metrics[key]
        rows.append([name, d["mean"], d["median"], d["p90"], d["p99"]])
    print()
    print(format_table(["ms", "mean", "median", "p90", "p99"], rows))
    if offline is not None:
        pct = offline["server_output_throughput_pct"]
        print(
            f"\nOffline LLM.generate (max_num_seqs {offline['max_num_seqs']}): "
            f"{offline['output_throughput']:.1f} output tok/s; the server reaches "
            + (f"{pct:.1f}% of it" if pct is not None else "an unknown fraction of it")
        )
    for path in plots:
        print(f"Plot: {path}")
