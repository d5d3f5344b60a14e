"""``pagedllm bench serve --baseline llama-server``: pagedllm's server against llama.cpp's, in turn.

The benchmark starts each server itself on the same GGUF file with the same thread count, one after
the other (never both at once): ``pagedllm serve`` (``--max-num-seqs`` = ``--parallel``, torch's threads
through ``OMP_NUM_THREADS``), then the native ``llama-server`` (:mod:`pagedllm_bench.native`;
``-np`` = ``--parallel`` slots of continuous batching, each slot's context holding the workload's
longest request). Each is driven by the same streaming client
(:func:`pagedllm_bench.serve_client.run_benchmark`) on the same requests, arrival process and
concurrency, then stopped. Reported per server: time until ready (start to ``/health`` answering
200, loading and warm-up included), output and total tokens/s, TTFT p50/p90, TPOT p50, the resident
memory of the server's processes after the run, and the ratios pagedllm / llama-server.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
from typing import Any

from pagedllm_bench.common import format_table, machine_info, now_iso, ratio, write_json
from pagedllm_bench.native import ensure_tools
from pagedllm_bench.native_run import Variant
from pagedllm_bench.serve_client import run_benchmark
from pagedllm_bench.serve_report import summarize
from pagedllm_bench.servers import (
    free_port,
    llama_server_command,
    pagedllm_server_command,
    process_memory,
    start_server,
    stop_server,
    thread_env,
)
from pagedllm_bench.workloads import Workload

logger = logging.getLogger("pagedllm_bench")

BASELINES = ("llama-server",)
SERVED_NAME = "model"


def add_cli_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--baseline",
        default=None,
        choices=list(BASELINES),
        help="Start pagedllm serve and llama.cpp's llama-server in turn on the --model GGUF file (the same "
        "threads) and drive both with this workload, instead of a running server at --base-url.",
    )
    group.add_argument(
        "--parallel",
        type=int,
        default=16,
        help="With --baseline: llama-server's slots (-np) and pagedllm's --max-num-seqs (default 16).",
    )
    group.add_argument(
        "--llama-omp-wait",
        choices=["default", "passive"],
        default="default",
        help="With --baseline: llama-server's OpenMP wait policy (default: OpenMP's own).",
    )
    group.add_argument(
        "--llama-repack",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="With --baseline: llama-server's weight repacking (default on; --no-llama-repack where it fails).",
    )
    group.add_argument(
        "--server-start-timeout",
        type=float,
        default=900.0,
        help="With --baseline: seconds each server may take to become ready (default 900).",
    )


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag that cannot go with ``--baseline``."""
    if args.parallel < 1:
        raise ValueError(f"--parallel must be at least 1, got {args.parallel}.")
    if args.server_start_timeout <= 0:
        raise ValueError(f"--server-start-timeout must be positive, got {args.server_start_timeout}.")
    if args.baseline is None:
        return
    if args.compare_offline or args.poll_dashboard is not None or args.priority_mix is not None:
        raise ValueError(
            "--baseline llama-server starts both servers itself; it cannot be combined with "
            "--compare-offline, --poll-dashboard or --priority-mix."
        )
    if args.model is None or not str(args.model).endswith(".gguf") or not os.path.isfile(args.model):
        raise ValueError(
            f"--baseline llama-server needs --model FILE.gguf (both servers load it), got {args.model!r}."
        )


def _tree_memory(pid: int) -> float:
    """Resident MiB of a process and its descendants (pagedllm serves from a front-end and a core)."""
    total = 0.0
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            total += process_memory(p).get("VmRSS", 0.0)
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children", encoding="utf-8") as f:
                    stack.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return total


def _one_server(args: argparse.Namespace, name: str, workload: Workload, threads: int) -> dict[str, Any]:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    if name == "pagedllm":
        cmd = pagedllm_server_command(args.model, port, args.parallel, SERVED_NAME)
        env = thread_env(threads)
        variant_label = None
        omp_wait: str | None = None
    else:
        longest = max(r.prompt_len + r.output_len for r in workload.requests)
        variant = Variant(
            args.llama_repack, None if args.llama_omp_wait == "default" else args.llama_omp_wait
        )
        cmd = llama_server_command(
            ensure_tools(),
            args.model,
            port,
            threads,
            parallel=args.parallel,
            ctx_per_slot=math.ceil((longest + 16) / 256) * 256,
            variant=variant,
            alias=SERVED_NAME,
        )
        env = thread_env(threads, variant.env())
        variant_label = variant.label
        omp_wait = variant.omp_wait_policy
    print(f"{name}: starting ({' '.join(cmd)})", flush=True)
    try:
        server = start_server(name, cmd, base_url, "/health", args.server_start_timeout, env)
    except RuntimeError as exc:
        if name == "pagedllm" or "--no-repack" in cmd:
            raise
        # The repacked weights fail in some builds (e.g. the warm-up decode crashes): without them.
        logger.warning(
            "llama-server failed with repacked weights (%s); starting it with --no-repack.", str(exc)[-200:]
        )
        cmd.append("--no-repack")
        variant_label = Variant(False, omp_wait).label
        server = start_server(name, cmd, base_url, "/health", args.server_start_timeout, env)
    try:
        results, duration, _ = asyncio.run(
            run_benchmark(
                base_url,
                workload.requests,
                model=SERVED_NAME,
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
        rss = _tree_memory(server.proc.pid)
    finally:
        stop_server(server)
    metrics = summarize(results, duration, {})
    return {
        "server": name,
        "command": " ".join(cmd),
        "variant": variant_label,
        "ready_s": server.ready_s,
        "rss_mib": rss,
        **metrics,
    }


def run(args: argparse.Namespace, workload: Workload) -> int:
    """Both servers in turn on ``workload``; the comparison table (and JSON)."""
    threads = args.num_threads or os.cpu_count() or 1
    sides: list[dict[str, Any]] = []
    for name in ("pagedllm", "llama-server"):
        try:
            sides.append(_one_server(args, name, workload, threads))
        except (RuntimeError, OSError) as exc:
            logger.error("%s failed: %s", name, exc)
            return 1
    rows = []
    for s in sides:
        rows.append(
            [
                s["server"],
                s["ready_s"],
                s["output_throughput"],
                s["total_token_throughput"],
                s["ttft_ms"]["p50"],
                s["ttft_ms"]["p90"],
                s["tpot_ms"]["p50"],
                f"{s['completed']}/{s['completed'] + s['failed']}",
                s["rss_mib"],
            ]
        )
    ours, theirs = sides
    ratios = {
        "output_throughput": ratio(ours["output_throughput"], theirs["output_throughput"]),
        "ttft_p50": ratio(ours["ttft_ms"]["p50"], theirs["ttft_ms"]["p50"]),
        "ttft_p90": ratio(ours["ttft_ms"]["p90"], theirs["ttft_ms"]["p90"]),
        "ready_s": ratio(ours["ready_s"], theirs["ready_s"]),
    }
    rows.append(
        [
            "ratio",
            ratios["ready_s"],
            ratios["output_throughput"],
            ratio(ours["total_token_throughput"], theirs["total_token_throughput"]),
            ratios["ttft_p50"],
            ratios["ttft_p90"],
            ratio(ours["tpot_ms"]["p50"], theirs["tpot_ms"]["p50"]),
            "",
            ratio(ours["rss_mib"], theirs["rss_mib"]),
        ]
    )
    print(
        f"\n{os.path.basename(args.model)}, {threads} threads, {len(workload.requests)} requests, "
        f"{args.parallel} slots, rate {args.request_rate} req/s, max concurrency {args.max_concurrency or 'unlimited'}\n"
    )
    headers = [
        "server",
        "ready s",
        "output tok/s",
        "total tok/s",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "TPOT p50 ms",
    ]
    print(format_table([*headers, "completed", "RSS MiB"], rows))
    for s in sides:
        if s["errors"]:
            print(f"{s['server']} errors: {s['errors']}")
    if args.output_json:
        write_json(
            args.output_json,
            {
                "benchmark": "serve-versus",
                "date": now_iso(),
                "model": os.path.abspath(args.model),
                "threads": threads,
                "machine": machine_info(),
                "workload": workload.summary(),
                "servers": sides,
                "ratios": ratios,
            },
        )
        print(f"\nWrote {args.output_json}")
    return 0 if all(s["completed"] for s in sides) else 1
