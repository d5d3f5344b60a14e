"""Starting and stopping the engine-core processes of this machine, and the front-ends' addresses."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace

import msgspec

from pagedllm.config import EngineConfig

logger = logging.getLogger("pagedllm")


@dataclass
class CoreOptions:
    """How a core process runs (besides the engine arguments)."""

    rank: int  # data-parallel rank
    frontend_address: str  # front-end 0's socket, e.g. tcp://127.0.0.1:5570
    max_queued_requests: int | None = None
    grammar_compile_timeout: float = 10.0
    log_stats_interval: float | None = 5.0
    report_cache_events: bool = False  # send prefix-cache registrations/evictions (data parallel)
    log_level: str = "info"


def frontend_addresses(host: str, rpc_port: int, count: int) -> list[str]:
    """The sockets of front-ends 0..count-1: consecutive ports from ``rpc_port``."""
    return [f"tcp://{host}:{rpc_port + i}" for i in range(count)]


@dataclass
class LocalCores:
    """The core processes this machine started, by rank."""

    processes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self.processes.items()}

    def exitcode(self, rank: int) -> int | None:
        """The exit status of a core's process (negative: the signal that killed it), None while
        it runs (or for a rank this machine does not run)."""
        proc = self.processes.get(rank)
        return proc.poll() if proc is not None else None

    def any_alive(self) -> bool:
        return any(p.poll() is None for p in self.processes.values())

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every process to exit; True when all have."""
        deadline = time.monotonic() + timeout
        for proc in self.processes.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return not self.any_alive()

    def terminate(self) -> None:
        """SIGTERM every core still running (a core exits cleanly on it)."""
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.terminate()

    def stop(self, timeout: float = 5.0) -> None:
        """Wait up to ``timeout`` seconds for the cores to exit (they were told to), then SIGTERM,
        then SIGKILL what is left; every process is reaped."""
        if self.join(timeout):
            return
        self.terminate()
        if self.join(3.0):
            return
        for proc in self.processes.values():
            if proc.poll() is None:
                logger.warning("Engine core (pid %s) did not stop; killing it.", proc.pid)
                proc.kill()
        self.join(3.0)


def start_local_cores(config: EngineConfig, ranks: list[int], options: CoreOptions) -> LocalCores:
    """Start one core process per rank (``options`` with its rank), connecting to
    ``options.frontend_address``. Each is a fresh interpreter (``python -m
    pagedllm.engine.proc.core_process``) given its configuration as JSON, so nothing of the caller's
    main module is imported again."""
    cores = LocalCores()
    for rank in ranks:
        spec = msgspec.json.encode({"config": config, "options": replace(options, rank=rank)})
        cmd = [sys.executable, "-m", "pagedllm.engine.proc.core_process", spec.decode()]
        cores.processes[rank] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    return cores


__all__ = ["CoreOptions", "LocalCores", "frontend_addresses", "start_local_cores"]
