"""``pagedllm bench startup``: how long ``pagedllm serve`` takes to start and to stop.

Each of ``--repeats`` runs launches ``python -m pagedllm serve`` on a free local port with the
arguments after ``--`` (default: the default model with a 1,024-token context and 256 KV blocks),
and measures

* start: from the launch to the first ``200`` from ``/health`` (polled every 20 ms);
* stop: from SIGTERM to the exit of the whole process tree (its status must be 0).

The figures are the median and the smallest of the runs. Nothing is left running: a run that does
not become ready within ``--timeout`` seconds, or exits with another status, is an error, and its
process tree is killed.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx
import psutil

from pagedllm_bench.common import format_table, now_iso, write_json

logger = logging.getLogger("pagedllm_bench")

DEFAULT_SERVE_ARGS = ["--max-model-len", "1024", "--num-kv-blocks", "256"]
POLL_S = 0.02


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=3, help="Server starts to time.")
    parser.add_argument("--timeout", type=float, default=180.0, help="Seconds a start or a stop may take.")
    parser.add_argument("--output-json", default=None, help="Write the results to this JSON file.")
    parser.add_argument(
        "serve_args",
        nargs=argparse.REMAINDER,
        help=f"Arguments for 'pagedllm serve', after '--' (default: {' '.join(DEFAULT_SERVE_ARGS)}).",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    try:
        tree = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=10)


def time_one_start(serve_args: list[str], timeout: float) -> tuple[float, float]:
    """(start seconds, stop seconds) of one ``pagedllm serve``; RuntimeError when it fails."""
    port = _free_port()
    cmd = [sys.executable, "-m", "pagedllm", "serve", "--host", "127.0.0.1", "--port", str(port), *serve_args]
    began = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"pagedllm serve exited with status {proc.returncode} while starting")
            if time.perf_counter() - began > timeout:
                raise RuntimeError(f"pagedllm serve was not ready after {timeout:.0f} s")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(POLL_S)
        started = time.perf_counter() - began
        tree = psutil.Process(proc.pid).children(recursive=True)
        stopping = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout)
        psutil.wait_procs(tree, timeout=timeout)
        stopped = time.perf_counter() - stopping
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    if status != 0:
        raise RuntimeError(f"pagedllm serve exited with status {status} after SIGTERM")
    return started, stopped


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
