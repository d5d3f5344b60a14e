"""``pagedllm bench startup``: how long ``pagedllm serve`` takes to start and to stop.

Each of ``--repeats`` runs launches ``python -m pagedllm serve`` on a free local port with the
arguments after ``--`` (default: the default model with a 1,024-token context and 256 KV blocks),
and measures

* start: from the launch to the first ``200`` from ``/health`` (polled every 0.1 s);
* stop: from SIGTERM to the exit of the whole process tree (its status must be 0).

The figures are the median and the smallest of the runs. The server is started and stopped as the
other server benchmarks do (:mod:`pagedllm_bench.servers`). Nothing is left running: a run that does
not become ready within ``--timeout`` seconds, or exits with another status, is an error, and the
server is stopped (it takes its own processes down with it).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from typing import Any

import psutil

from pagedllm_bench.common import format_table, now_iso, write_json
from pagedllm_bench.servers import free_port, start_server, stop_server

logger = logging.getLogger("pagedllm_bench")

DEFAULT_SERVE_ARGS = ["--max-model-len", "1024", "--num-kv-blocks", "256"]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=3, help="Server starts to time.")
    parser.add_argument("--timeout", type=float, default=180.0, help="Seconds a start or a stop may take.")
    parser.add_argument("--output-json", default=None, help="Write the results to this JSON file.")
    parser.add_argument(
        "serve_args",
        nargs=argparse.REMAINDER,
        help=f"Arguments for 'pagedllm serve', after '--' (default: {' '.join(DEFAULT_SERVE_ARGS)}).",
    )


def time_one_start(serve_args: list[str], timeout: float) -> tuple[float, float]:
    """(start seconds, stop seconds) of one ``pagedllm serve``; RuntimeError when it fails."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm", "serve", "--host", "127.0.0.1", "--port", str(port), *serve_args]
    server = start_server("pagedllm", cmd, f"http://127.0.0.1:{port}", "/health", timeout)
    try:
        tree = psutil.Process(server.proc.pid).children(recursive=True)
        stopping = time.perf_counter()
        server.proc.terminate()
        status = server.proc.wait(timeout)
        psutil.wait_procs(tree, timeout=timeout)
        stopped = time.perf_counter() - stopping
    finally:
        stop_server(server)
    if status != 0:
        raise RuntimeError(f"pagedllm serve exited with status {status} after SIGTERM")
    return server.ready_s, stopped


def run(args: argparse.Namespace) -> int:
    serve_args = [a for a in args.serve_args if a != "--"] or DEFAULT_SERVE_ARGS
    if args.repeats < 1:
        logger.error("--repeats must be at least 1, got %d", args.repeats)
        return 2
    runs: list[dict[str, float]] = []
    for i in range(args.repeats):
        try:
            start, stop = time_one_start(serve_args, args.timeout)
        except RuntimeError as exc:
            logger.error("run %d: %s", i + 1, exc)
            return 1
        runs.append({"start_s": start, "stop_s": stop})
    summary: dict[str, Any] = {}
    for key in ("start_s", "stop_s"):
        values = [r[key] for r in runs]
        summary[key] = {"median": statistics.median(values), "min": min(values)}
    print(
        format_table(
            ["", "median s", "min s"],
            [[k.removesuffix("_s"), v["median"], v["min"]] for k, v in summary.items()],
        )
    )
    if args.output_json:
        write_json(
            args.output_json,
            {"date": now_iso(), "serve_args": serve_args, "runs": runs, **summary},
        )
    return 0
