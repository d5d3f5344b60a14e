"""How a front-end tells whether an engine core lives: the silence it allows, and the state of a
core process on this machine.

Cores send a heartbeat every :data:`~pagedllm.engine.proc.core_process.HEARTBEAT_S` (0.2 s) from an I/O
thread that a long forward does not block. A core silent for :func:`unresponsive_after` seconds (2 s,
or half the liveness timeout if that is shorter) is *unresponsive* (``/health`` says 503 until it is
heard from again); one silent for the liveness timeout (``--engine-liveness-timeout``, default
:data:`DEFAULT_LIVENESS_TIMEOUT_S`) is taken for dead, and killed when this machine runs it.
"""

from __future__ import annotations

import os
import signal

# 25 missed heartbeats: far beyond the scheduling delays of a busy machine, short enough that a
# stopped or hung core's requests do not wait long for their error.
DEFAULT_LIVENESS_TIMEOUT_S = 5.0
# 10 missed heartbeats (at most half the liveness timeout): beyond an overloaded machine's gaps.
UNRESPONSIVE_AFTER_S = 2.0
# The smallest liveness timeout accepted: below it, ordinary jitter would look like death.
MIN_LIVENESS_TIMEOUT_S = 1.0


def unresponsive_after(liveness_timeout: float) -> float:
    """Seconds of silence after which a core is unresponsive, for a liveness timeout."""
    return min(UNRESPONSIVE_AFTER_S, liveness_timeout / 2)


def describe_exit(code: int | None) -> str:
    """A process's exit status in words ("was killed by SIGKILL", "exited with status 1")."""
    if code is None:
        return "is running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def pid_state(pid: int) -> str | None:
    """The state letter of a process (None when it no longer exists; 'Z' for a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rindex(b")") + 2 : data.rindex(b")") + 3].decode()


def kill_process(pid: int) -> None:
    """SIGKILL ``pid`` (a stopped process dies too); nothing when it is already gone."""
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


__all__ = [
    "DEFAULT_LIVENESS_TIMEOUT_S",
    "MIN_LIVENESS_TIMEOUT_S",
    "UNRESPONSIVE_AFTER_S",
    "describe_exit",
    "kill_process",
    "pid_state",
    "unresponsive_after",
]
