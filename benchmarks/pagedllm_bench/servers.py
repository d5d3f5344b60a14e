"""Server processes started by a benchmark: ``pagedllm serve`` and the native ``llama-server``.

:func:`start_server` starts a command with its output in a log file, and waits (with a timeout) until
an HTTP path answers 200: the time until then is the server's time until ready (model loading and
warm-up included). :func:`stop_server` asks it to stop, kills it when it does not within a timeout,
and reaps it; a server is never left running. :func:`process_memory` reads a process's resident
memory from ``/proc``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from pagedllm.utils import free_port_range
from pagedllm_bench.native import NativeTools
from pagedllm_bench.native_run import Variant


@dataclass
class ServerProcess:
    """A started server: its process, URL, time until ready and log file."""

    name: str
    proc: subprocess.Popen[bytes]
    base_url: str
    ready_s: float
    log_path: str


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (outside the ephemeral range, as the engine's own ports)."""
    return free_port_range("127.0.0.1")


def _log_tail(path: str, chars: int = 2000) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def start_server(
    name: str,
    cmd: list[str],
    base_url: str,
    ready_path: str,
    timeout_s: float,
    env: dict[str, str] | None = None,
) -> ServerProcess:
    """Start ``cmd`` and wait until ``base_url + ready_path`` answers 200; RuntimeError (with the log's
    tail) when the process exits first or ``timeout_s`` passes (the process is then stopped)."""
    fd, log_path = tempfile.mkstemp(prefix=f"pagedllm-bench-{name}-", suffix=".log")
    with os.fdopen(fd, "wb") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(name, proc, base_url, 0.0, log_path)
    deadline = start + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{name} exited with status {proc.returncode} before it was ready: {_log_tail(log_path)}"
            )
        try:
            with urllib.request.urlopen(base_url + ready_path, timeout=5) as resp:
                if resp.status == 200:
                    break
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.perf_counter() > deadline:
            stop_server(server)
            raise RuntimeError(f"{name} was not ready within {timeout_s:.0f} s: {_log_tail(log_path)}")
        time.sleep(0.1)
    server.ready_s = time.perf_counter() - start
    return server


def stop_server(server: ServerProcess, timeout_s: float = 30.0) -> None:
    """Stop the server (SIGTERM, then SIGKILL after ``timeout_s``) and reap it."""
    proc = server.proc
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)
    assert proc.poll() is not None


def process_memory(pid: int) -> dict[str, float]:
    """A process's resident memory in MiB: ``VmRSS`` and its ``RssAnon``/``RssFile`` parts."""
    out: dict[str, float] = {}
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) / 1024
    return out


def llama_server_command(
    tools: NativeTools,
    model: str,
    port: int,
    threads: int,
    *,
    parallel: int,
    ctx_per_slot: int,
    variant: Variant,
    alias: str = "model",
) -> list[str]:
    """``llama-server`` on ``model``: ``parallel`` slots of ``ctx_per_slot`` cells each, continuous
    batching (its default), ``threads`` threads for prompts and generation, no web UI."""
    cmd = [
        tools.path("llama-server"),
        "-m",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-np",
        str(parallel),
        "-c",
        str(parallel * ctx_per_slot),
        "--cont-batching",
        "--no-webui",
        "-a",
        alias,
    ]
    if not variant.repack:
        cmd.append("--no-repack")
    return cmd


def pagedllm_server_command(model: str, port: int, max_num_seqs: int, alias: str = "model") -> list[str]:
    """``pagedllm serve`` on ``model`` with at most ``max_num_seqs`` running requests."""
    return [
        sys.executable,
        "-m",
        "pagedllm",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-num-seqs",
        str(max_num_seqs),
        "--served-model-name",
        alias,
    ]


def thread_env(threads: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment with ``threads`` OpenMP (and so torch) threads."""
    env = dict(os.environ if base is None else base)
    env["OMP_NUM_THREADS"] = str(threads)
    return env
