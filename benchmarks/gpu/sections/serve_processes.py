"""``serve_processes``: ``pagedllm serve`` as users run it (the engine in a core process of its own,
``--api-server-count`` front-end processes), streaming ``/v1/completions`` of the same requests as
the ``serve`` section to a load generator in this process, against that section's offline run of
those requests: output tokens per second and their ratio, per front-end count.

The section runs after the shared in-process engine has released the device, so the server's core
has the device to itself. The client is :func:`pagedllm_bench.serve_client.run_benchmark` (the
load generator of ``pagedllm bench serve``), all requests at once. Each server's processes are
sampled with psutil for their CPU time, so the host cost per engine step is on record next to the
decode section's CPU share of a step.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

from pagedllm.utils import free_port_range
from pagedllm_bench.workloads import BenchRequest

from .common import Settings

START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
LEFTOVER_TIMEOUT_S = 15.0  # how long the stopped server's processes may take to disappear


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server was not healthy within {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen[bytes]) -> int | None:
    """SIGTERM the server (it drains and stops its cores), then SIGKILL its group if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    return proc.returncode


def _tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its living descendants (NaN without psutil)."""
    try:
        import psutil
    except ImportError:
        return float("nan")

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _tree_pids(pid: int) -> list[int]:
    """``pid`` and its descendants (empty without psutil)."""
    try:
        import psutil
    except ImportError:
        return []
    try:
        return [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        return []


def _still_running(pids: list[int]) -> int:
    """How many of ``pids`` are still running (zombies awaiting their parent do not count)."""
    try:
        import psutil
    except ImportError:
        return 0
    alive = 0
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive += 1
        except psutil.Error:
            pass
    return alive


def _wait_gone(pids: list[int], timeout_s: float) -> int:
    """Poll until none of ``pids`` runs or ``timeout_s`` passes; how many still run then.

    The cores exit right after the front-end's last word to them, but on a busy machine that can
    take a moment after the launcher itself has gone.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        alive = _still_running(pids)
        if alive == 0 or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


def server_command(
    model_dir: str, port: int, api_server_count: int, settings: Settings, state: Any
) -> list[str]:
    """The ``pagedllm serve`` command line matching the shared engine's configuration."""
    args = state.args
    cmd = [
        sys.executable,
        "-m",
        "pagedllm.entrypoints.cli",
        "serve",
        model_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--api-server-count",
        str(api_server_count),
        "--dtype",
        state.dtype_name,
        "--device",
        str(state.device),
        "--max-num-seqs",
        str(settings.max_num_seqs),
        "--max-model-len",
        str(settings.max_model_len),
        "--max-num-batched-tokens",
        str(settings.max_num_batched_tokens),
        "--seed",
        str(args.seed),
    ]
    if args.attention_backend:
        cmd += ["--attention-backend", args.attention_backend]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    return cmd


def serve_once(
    cmd: list[str], port: int, requests: list[BenchRequest], temperature: float, log_path: str
) -> dict[str, Any]:
    """Start one server, stream every request at once (after one warm-up request), stop it."""
    from pagedllm_bench.serve_client import run_benchmark

    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(url, proc, START_TIMEOUT_S)
        startup = time.perf_counter() - t0
        # Warm-up, outside the measured CPU and time: every request's prompt reversed (the same
        # shapes, no prefix-cache hits for the measured run), two output tokens each.
        warm = [BenchRequest(r.prompt_token_ids[::-1], 2) for r in requests]
        asyncio.run(run_benchmark(url, warm, model="bench", temperature=temperature))
        cpu_before = _tree_cpu_s(proc.pid)
        results, duration, _ = asyncio.run(
            run_benchmark(url, requests, model="bench", temperature=temperature, warmup=False)
        )
        cpu = _tree_cpu_s(proc.pid) - cpu_before
    finally:
        pids = _tree_pids(proc.pid)
        status = _stop(proc)
        leftover = _wait_gone(pids, LEFTOVER_TIMEOUT_S)
    with open(log_path, "rb") as f:
        log_tail = f.read()[-3000:].decode(errors="replace")
    failed = [r.error for r in results if not r.success]
    output_tokens = sum(r.output_tokens for r in results)
    return {
        "startup_s": startup,
        "elapsed_s": duration,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration,
        "failed": len(failed),
        "first_error": failed[0] if failed else None,
        "server_cpu_s": cpu,
        "server_cpu_share_of_wall": cpu / duration,
        "exit_status": status,
        "processes_left_running": leftover,
        "log_tail": log_tail,
    }


def section_serve_processes(
    state: Any,
    settings: Settings,
    requests: list[BenchRequest],
    temperature: float,
    max_output: int,
    serve_result: dict[str, Any],
    workdir: str,
    api_server_counts: tuple[int, ...] = (1, 2),
) -> dict[str, Any]:
    """``pagedllm serve`` with each front-end count against the ``serve`` section's offline run."""
    assert state.model_dir is not None
    reqs = [BenchRequest(r.prompt_token_ids, min(r.output_len, max_output)) for r in requests]
    offline = serve_result["offline"]
    expected = offline["expected_output_tokens"]
    runs: dict[str, Any] = {}
    for count in api_server_counts:
        port = free_port_range("127.0.0.1")
        cmd = server_command(state.model_dir, port, count, settings, state)
        run = serve_once(cmd, port, reqs, temperature, os.path.join(workdir, f"serve-{count}.log"))
        run["server_over_offline"] = run["output_tokens_per_s"] / offline["output_tokens_per_s"]
        problems = {
            "failed requests": run["failed"] != 0,
            f"output tokens {run['output_tokens']} != {expected}": run["output_tokens"] != expected,
            f"exit status {run['exit_status']}": run["exit_status"] != 0,
            f"{run['processes_left_running']} processes left running": run["processes_left_running"] != 0,
        }
        run["problems"] = [text for text, bad in problems.items() if bad]
        run["passed"] = not run["problems"]
        runs[str(count)] = run
    best = max(runs.values(), key=lambda r: r["server_over_offline"])
    return {
        "num_requests": len(reqs),
        "max_output_tokens": max_output,
        "offline_output_tokens_per_s": offline["output_tokens_per_s"],
        "runs_by_api_server_count": runs,
        "best_server_over_offline": best["server_over_offline"],
        "passed": all(r["passed"] for r in runs.values()),
        "note": "pagedllm serve (core process, N front-ends) streaming /v1/completions of the serve "
        "section's requests all at once to the bench serve load generator in this process, against "
        "that section's LLM.generate run of the same requests.",
    }
