"""CPU threads that follow the cores other processes leave free.

A CPU step runs its kernels on a team of OpenMP threads that meet at a barrier after every parallel
region. When another process takes one of the cores, the team's thread on that core runs only part
of the time, and every region waits for it: on two cores with a busy loop beside it, decoding ran
16 times slower with two threads than with one. :class:`ThreadGovernor` measures, between steps,
how much CPU time other processes took on the cores this process may run on (``/proc/stat``
against this process's own time), and sizes the team to the cores left: ``max_threads`` when the
machine is otherwise idle, fewer while a neighbour computes, back to ``max_threads`` when it stops.

Invariants:

- The team is never larger than ``max_threads`` (the size the process started with, or the
  configured one) nor smaller than 1.
- The team changes only at a step boundary (:meth:`ThreadGovernor.before_step`, on the thread that
  runs the step, whose OpenMP settings the kernels use), at most once per ``interval_s``, and only
  when the measured free cores say so beyond a hysteresis margin, so that noise does not make it
  flap.
- The native kernels split work into pieces independent of the team size, so the size changes
  speed, never results.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger("pagedllm")

INTERVAL_S = 0.5  # the least time between two measurements
MARGIN = 0.2  # cores of hysteresis around a change of team size


@dataclass(frozen=True)
class CpuTimes:
    """Seconds of CPU time: ``busy`` on the watched cores (all processes), ``own`` of this process."""

    busy: float
    own: float


def read_cpu_times(cpus: frozenset[int]) -> CpuTimes | None:
    """The CPU times now, from ``/proc/stat`` (the lines of ``cpus``) and :func:`os.times`; None where
    ``/proc/stat`` cannot be read (not Linux)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            lines = f.readlines()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    busy = 0
    for line in lines:
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *values = line.split()
        if int(name[3:]) not in cpus:
            continue
        # user nice system idle iowait irq softirq steal ...: all but idle and iowait is busy.
        numbers = [int(v) for v in values[:8]]
        busy += sum(numbers) - numbers[3] - numbers[4]
    own = os.times()
    return CpuTimes(busy / tick, own.user + own.system)


def allowed_cpus() -> frozenset[int]:
    """The cores this process may run on."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


class ThreadGovernor:
    """Sizes the step's OpenMP team to the cores that other processes leave free (see the module
    docstring). ``read`` and ``clock`` are injectable for tests."""

    def __init__(
        self,
        max_threads: int,
        *,
        cpus: frozenset[int] | None = None,
        interval_s: float = INTERVAL_S,
        read: Callable[[frozenset[int]], CpuTimes | None] = read_cpu_times,
        clock: Callable[[], float] = time.monotonic,
        apply: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be at least 1, got {max_threads}.")
        self.max_threads = max_threads
        self.cpus = cpus if cpus is not None else allowed_cpus()
        self.interval_s = interval_s
        self._read, self._clock, self._apply = read, clock, apply
        self.threads = max_threads
        self.others = 0.0  # cores other processes used over the latest interval
        self.changes = 0
        self._last: tuple[float, CpuTimes] | None = None
        self._applied = False

    def before_step(self) -> int:
        """Measure if an interval has passed, resize the team if the free cores say so; the team
        size for the step about to run."""
        now = self._clock()
        if self._last is None or now - self._last[0] >= self.interval_s:
            times = self._read(self.cpus)
            if times is not None:
                if self._last is not None:
                    self._measure(now - self._last[0], self._last[1], times)
                self._last = (now, times)
        if not self._applied:  # on the step's own thread, whatever the first measurement says
            self._apply(self.threads)
            self._applied = True
        return self.threads

    def _measure(self, elapsed: float, before: CpuTimes, after: CpuTimes) -> None:
        # Another process's time: all busy time on the watched cores but this process's own (which
        # may include time on other cores: never below 0).
        self.others = max(0.0, (after.busy - before.busy) - (after.own - before.own)) / elapsed
        free = len(self.cpus) - self.others
        # The nearest whole number of free cores, changed only when ``free`` is beyond the half-way
        # mark by the margin (2 -> 1 when others use over 0.7 of a core, 1 -> 2 under 0.3).
        wanted = self.threads
        if free < self.threads - 0.5 - MARGIN or free > self.threads + 0.5 + MARGIN:
            wanted = math.floor(free + 0.5)
        wanted = max(1, min(self.max_threads, wanted))
        if wanted != self.threads:
            logger.info(
                "CPU threads %d -> %d: other processes used %.2f of %d cores.",
                self.threads,
                wanted,
                self.others,
                len(self.cpus),
            )
            self.threads = wanted
            self.changes += 1
            self._apply(wanted)
