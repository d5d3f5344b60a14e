"""Checks on the processes a test started: alive (zombies count as gone), described, all gone."""

from __future__ import annotations

import time

import psutil


def alive(proc: psutil.Process) -> bool:
    """Whether ``proc`` still runs (an exited child not yet reaped counts as gone)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def cmdline(proc: psutil.Process, limit: int = 160) -> str:
    """``proc``'s command line (at most ``limit`` characters), or "?" once it is gone."""
    try:
        return " ".join(proc.cmdline())[:limit]
    except psutil.Error:
        return "?"


def describe(procs: list[psutil.Process]) -> list[tuple[int, str]]:
    """``(pid, command line)`` of each process, for assertion messages."""
    return [(proc.pid, cmdline(proc)) for proc in procs]


def wait_gone(procs: list[psutil.Process], timeout: float = 10.0, what: str = "left running") -> None:
    """Assert that every process of ``procs`` exits within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in procs if alive(p)]
    assert not left, f"{what}: {describe(left)}"
