"""Checks on the processes a test started: alive (zombies count as gone), described, all gone, and
this test process's own descendants apart from the servers that session-scoped fixtures keep."""

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


# Processes that session-scoped fixtures keep for the whole run (a test server shared by many test
# files): they and their descendants belong to no one test, so checks of "what this test started" or
# "nothing left behind" leave them out. A fixture adds its process when it starts and removes it when
# it stops.
SESSION_PIDS: set[int] = set()


def session_trees() -> set[int]:
    """The pids of the session-scoped fixtures' processes and of all their descendants."""
    pids = set()
    for pid in SESSION_PIDS:
        try:
            root = psutil.Process(pid)
            pids |= {pid, *(p.pid for p in root.children(recursive=True))}
        except psutil.Error:
            continue
    return pids


def own_descendants() -> list[psutil.Process]:
    """This process's descendants, less the session-scoped fixtures' process trees."""
    kept = session_trees()
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in kept]
