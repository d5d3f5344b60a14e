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

The client is :mod:`pagedllm_bench.serve_client`, the metrics and the printed report
:mod:`pagedllm_bench.serve_report`.

``--priority-mix LOW:HIGH`` measures priority scheduling (a server started with ``--scheduling-policy
priority``): the workload has ``LOW + HIGH`` requests; the first ``LOW`` (priority 1) are sent together
and saturate the server, and once they all stream the ``HIGH`` others (priority 0) arrive at
``--request-rate``. The report adds each class's TTFT and the high/low ratio of the TTFT p50 and p90
(:mod:`pagedllm_bench.serve_priority`).

``--compare-offline`` then runs the same requests through ``LLM.generate`` in this process, with the
engine arguments given here (they should match the server's; ``max_num_seqs`` is capped at
``--max-concurrency`` so both batch alike), and reports the server's throughput as a percentage of
the offline one. ``--pairs N`` repeats the pair of runs N times, each pair on a workload of its own
(seeds ``seed``, ``seed + 1``, ...; so neither side finds the previous pair's prompts cached), and
reports the median share; the latency report is the first pair's.

``--baseline llama-server`` starts ``pagedllm serve`` and llama.cpp's native ``llama-server`` on the
``--model`` GGUF file in turn, instead of measuring a running server, and drives both with this
workload (:mod:`pagedllm_bench.serve_versus`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import time
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm_bench import serve_versus
from pagedllm_bench.common import machine_info, now_iso, peak_rss_mib, set_num_threads, write_json
from pagedllm_bench.serve_client import run_benchmark
from pagedllm_bench.serve_dashboard import compare_with_dashboard, format_comparison
from pagedllm_bench.serve_priority import (
    PriorityMix,
    parse_priority_mix,
    print_priority_report,
    priority_report,
    refusal_hint,
)
from pagedllm_bench.serve_report import (
    parse_slo,
    percent_of,
    print_report,
    request_records,
    summarize,
    token_timeline,
    write_plots,
)
from pagedllm_bench.workloads import Workload, add_workload_args, build_workload

logger = logging.getLogger("pagedllm_bench")


def load_offline(config: EngineConfig) -> Any:
    """The offline engine of the comparison (``LLM`` in this process), warmed up."""
    from pagedllm import LLM, SamplingParams

    engine_args = {k: v for k, v in dataclasses.asdict(config).items() if k != "model"}
    llm = LLM(config.model, **engine_args)
    llm.generate(
        [[11, 12, 13, 14, 15, 16, 17, 18]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False
    )
    return llm


def run_offline(llm: Any, workload: Workload, temperature: float, ignore_eos: bool) -> dict[str, Any]:
    """The same requests through ``llm.generate`` (an empty prefix cache first); throughput of that run."""
    from pagedllm import SamplingParams

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
    return {
        "elapsed_s": elapsed,
        "max_num_seqs": llm.llm_engine.config.max_num_seqs,
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
        "--priority-mix",
        default=None,
        metavar="LOW:HIGH",
        help="Priority scheduling under load, against a server started with --scheduling-policy priority: "
        "LOW + HIGH requests (this sets --num-prompts); the first LOW, of priority 1, are sent together "
        "at the start; once every one of them is streaming (or one has ended) the HIGH others, of "
        "priority 0, arrive at --request-rate. The report adds each class's TTFT p50/p90 and the ratio "
        "high p90 / low p90 (e.g. 64:16: does an urgent request get its first token fast while 64 "
        "streams run?). Not with --max-concurrency.",
    )
    group.add_argument(
        "--poll-dashboard",
        type=float,
        default=None,
        metavar="HZ",
        help="Measure an open dashboard's cost instead: run the workload in rounds without and with a "
        "client reading /v1/engine/state HZ times a second and /v1/engine/events, and print each "
        "side's output tok/s and their ratio (see --dashboard-rounds).",
    )
    group.add_argument(
        "--dashboard-rounds",
        type=int,
        default=2,
        help="Rounds of each side with --poll-dashboard (default 2).",
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
        "--pairs",
        type=int,
        default=1,
        help="Server run then offline run, this many times, each pair on a workload of its own (seed, "
        "seed + 1, ...): on a machine whose speed drifts, the median of the pairs' shares is steadier "
        "than one share (default 1).",
    )
    group.add_argument(
        "--num-threads", type=int, default=None, help="torch threads of the offline run (default: torch's)."
    )
    serve_versus.add_cli_args(parser.add_argument_group("against llama.cpp's server"))
    engine_group = parser.add_argument_group("engine (the workload's tokenizer; the offline comparison)")
    EngineConfig.add_cli_args(engine_group)  # type: ignore[arg-type]


def _check_args(args: argparse.Namespace) -> PriorityMix | None:
    """Refuse bad flags (ValueError naming the flag); the priority mix, which sets ``num_prompts``."""
    mix = parse_priority_mix(args.priority_mix)
    if mix is not None:
        if args.max_concurrency is not None:
            raise ValueError(
                "--priority-mix cannot be combined with --max-concurrency: the high-priority requests "
                "must reach the server while the low-priority ones run."
            )
        args.num_prompts = mix.num_requests
    if args.request_rate <= 0 or math.isnan(args.request_rate):
        raise ValueError(f"--request-rate must be positive, got {args.request_rate}.")
    if args.burstiness <= 0:
        raise ValueError(f"--burstiness must be positive, got {args.burstiness}.")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}.")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be non-negative, got {args.temperature}.")
    if args.pairs < 1:
        raise ValueError(f"--pairs must be at least 1, got {args.pairs}.")
    serve_versus.check_args(args)
    return mix


def _workload(args: argparse.Namespace) -> Workload:
    from pagedllm.model.loader import resolve_model_path
    from pagedllm.model.tokenizer import load_tokenizer

    kind, path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(args.tokenizer or path)
    exclude = {t for t in (tokenizer.eos_token_id, tokenizer.bos_token_id) if t is not None}
    return build_workload(args, len(tokenizer), tokenizer, exclude)


def _load_options(args: argparse.Namespace, config: EngineConfig) -> dict[str, Any]:
    """The ``run_benchmark`` options every run of this command takes from its flags."""
    return {
        "model": args.model_name or config.served_model_name,
        "api_key": args.api_key,
        "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "temperature": args.temperature,
        "ignore_eos": args.ignore_eos,
        "timeout_s": args.timeout,
    }


def _dashboard_cost(args: argparse.Namespace, workload: Workload, config: EngineConfig) -> int:
    """``--poll-dashboard``: the workload without and with a polling page, in alternating rounds."""

    def benchmark() -> Any:
        return run_benchmark(
            args.base_url,
            workload.requests,
            **_load_options(args, config),
            seed=args.seed,
            warmup=args.warmup,
        )

    try:
        comparison = compare_with_dashboard(
            benchmark, args.base_url, args.api_key, args.poll_dashboard, args.dashboard_rounds
        )
    except Exception as exc:  # noqa: BLE001 - e.g. the server is not reachable, or has no dashboard
        logger.error("Benchmark against %s failed: %s", args.base_url, exc)
        return 1
    print(format_comparison(comparison, args.poll_dashboard))
    if args.output_json:
        write_json(
            args.output_json, {"dashboard_cost": dataclasses.asdict(comparison), "ratio": comparison.ratio}
        )
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        mix = _check_args(args)
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
        + (f"; {mix.low} requests of priority 1, then {mix.high} of priority 0" if mix is not None else "")
    )
    if args.poll_dashboard is not None:
        return _dashboard_cost(args, workload, config)
    if args.baseline is not None:
        return serve_versus.run(args, workload)
    offline_llm: Any = None
    if args.compare_offline:
        offline_config = config
        if args.max_concurrency is not None and args.max_concurrency < config.max_num_seqs:
            offline_config = dataclasses.replace(config, max_num_seqs=args.max_concurrency)
        offline_llm = load_offline(offline_config)
    pairs: list[dict[str, Any]] = []
    first: tuple[list[Any], float, str, dict[str, Any], Workload] | None = None
    for pair in range(args.pairs if args.compare_offline else 1):
        pair_workload = (
            workload
            if pair == 0
            else _workload(argparse.Namespace(**{**vars(args), "seed": args.seed + pair}))
        )
        try:
            results, duration, model_name = asyncio.run(
                run_benchmark(
                    args.base_url,
                    pair_workload.requests,
                    **_load_options(args, config),
                    seed=args.seed + pair,
                    warmup=args.warmup and pair == 0,
                    priorities=mix.priorities() if mix is not None else None,
                    saturate_first=mix.low if mix is not None else 0,
                )
            )
        except Exception as exc:  # noqa: BLE001 - e.g. the server is not reachable
            logger.error("Benchmark against %s failed: %s", args.base_url, exc)
            hint = refusal_hint([str(exc)]) if mix is not None else None
            if hint is not None:
                logger.error("%s", hint)
            return 1
        pair_metrics = summarize(results, duration, slo)
        if first is None:
            first = (results, duration, model_name, pair_metrics, pair_workload)
        if offline_llm is not None:
            off = run_offline(offline_llm, pair_workload, args.temperature, args.ignore_eos)
            off["server_output_throughput"] = pair_metrics["output_throughput"]
            off["server_output_throughput_pct"] = percent_of(
                pair_metrics["output_throughput"], off["output_throughput"]
            )
            off["server_total_token_throughput_pct"] = percent_of(
                pair_metrics["total_token_throughput"], off["total_token_throughput"]
            )
            pairs.append(off)
            if args.pairs > 1:
                print(
                    f"pair {pair}: server {pair_metrics['output_throughput']:.1f}, offline "
                    f"{off['output_throughput']:.1f} output tok/s: {off['server_output_throughput_pct']:.1f}%"
                )
    assert first is not None
    results, duration, model_name, metrics, workload = first
    bin_s = max(0.25, round(duration / 60, 2))
    timeline = token_timeline(results, duration, bin_s)
    offline: dict[str, Any] | None = None
    if pairs:
        offline = dict(pairs[0])
        shares = sorted(p["server_output_throughput_pct"] for p in pairs)
        offline["pairs"] = pairs
        offline["median_server_output_throughput_pct"] = (
            shares[len(shares) // 2]
            if len(shares) % 2
            else ((shares[len(shares) // 2 - 1] + shares[len(shares) // 2]) / 2)
        )

    plots: list[str] = []
    if args.plot_dir:
        title = (
            f"{len(workload.requests)} requests, rate {args.request_rate}, concurrency {args.max_concurrency}"
        )
        plots = write_plots(results, timeline, args.plot_dir, title)

    print_report(metrics, offline, plots)
    priorities: dict[str, Any] | None = None
    if mix is not None:
        priorities = priority_report(results, mix)
        print_priority_report(priorities)
        hint = refusal_hint(metrics["errors"])
        if hint is not None:
            logger.error("%s", hint)
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
            "priority_mix": priorities,
            "timeline": timeline,
            "offline": offline,
            "engine_config": dataclasses.asdict(config) if args.compare_offline else None,
            "plots": plots,
        }
        if args.save_requests:
            data["requests"] = request_records(results)
        write_json(args.output_json, data)
        print(f"\nWrote {args.output_json}")
    return 0 if metrics["completed"] else 1
