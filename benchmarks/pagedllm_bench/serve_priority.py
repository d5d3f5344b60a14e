"""The priority mix of ``pagedllm bench serve --priority-mix LOW:HIGH``: which requests are sent with
which priority, and the report of how the two classes fared.

The first ``LOW`` requests of the workload are the low class (priority :data:`LOW_PRIORITY`): they
are sent together at the start, so that they run side by side and saturate the server. The other
``HIGH`` requests are the high class (priority :data:`HIGH_PRIORITY`, which a server started with
``--scheduling-policy priority`` runs first): they start going out once every low request is
streaming (or one of them has ended, when the server cannot run them all at once), and arrive at
``--request-rate``. The report gives each class's TTFT distribution and the ratio of the high class's
TTFT percentiles to the low class's, e.g. ``ttft_p90_ratio`` = high p90 / low p90.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pagedllm_bench.common import distribution, format_table, ratio
from pagedllm_bench.serve_client import RequestResult

LOW_PRIORITY = 1
HIGH_PRIORITY = 0
PERCENTILES = (50, 90, 99)
# What the report compares between the classes.
RATIO_PERCENTILES = ("p50", "p90")


@dataclass(frozen=True)
class PriorityMix:
    """``low`` requests of priority ``LOW_PRIORITY`` first, then ``high`` of ``HIGH_PRIORITY``."""

    low: int
    high: int

    @property
    def num_requests(self) -> int:
        return self.low + self.high

    def priorities(self) -> list[int]:
        """The priority of each request of the workload, in order."""
        return [LOW_PRIORITY] * self.low + [HIGH_PRIORITY] * self.high

    def summary(self) -> dict[str, int]:
        return {
            "low_requests": self.low,
            "high_requests": self.high,
            "low_priority": LOW_PRIORITY,
            "high_priority": HIGH_PRIORITY,
        }


def parse_priority_mix(text: str | None) -> PriorityMix | None:
    """``"64:16"`` -> ``PriorityMix(low=64, high=16)``; None for None or an empty string."""
    if not text:
        return None
    low, sep, high = text.partition(":")
    try:
        mix = PriorityMix(int(low), int(high)) if sep else None
    except ValueError:
        mix = None
    if mix is None or mix.low < 1 or mix.high < 1:
        raise ValueError(
            f"--priority-mix must be LOW:HIGH, two positive request counts (e.g. 64:16); got {text!r}."
        )
    return mix


def _class_report(results: list[RequestResult], priority: int) -> dict[str, Any]:
    members = [r for r in results if r.priority == priority]
    ok = [r for r in members if r.success]
    return {
        "priority": priority,
        "requests": len(members),
        "completed": len(ok),
        "ttft_ms": {k: v * 1e3 for k, v in distribution([r.ttft for r in ok], PERCENTILES).items()},
    }


def priority_report(results: list[RequestResult], mix: PriorityMix) -> dict[str, Any]:
    """Per class: its priority, request and completion counts and TTFT distribution (ms); the
    high/low ratio of the TTFT percentiles (None when either class has no completed request); when
    the first high-priority request was sent (seconds after the start) and how many low-priority
    requests were streaming then."""
    low = _class_report(results, LOW_PRIORITY)
    high = _class_report(results, HIGH_PRIORITY)
    report: dict[str, Any] = {**mix.summary(), "low": low, "high": high}
    for p in RATIO_PERCENTILES:
        report[f"ttft_{p}_ratio"] = ratio(high["ttft_ms"][p], low["ttft_ms"][p])
    high_starts = [r.start for r in results if r.priority == HIGH_PRIORITY]
    first_high = min(high_starts) if high_starts else math.nan
    report["high_first_sent_s"] = first_high
    report["low_streaming_at_first_high"] = sum(
        1
        for r in results
        if r.priority == LOW_PRIORITY
        and r.chunk_times
        and r.chunk_times[0] <= first_high
        and not (r.success and r.start + r.latency <= first_high)
    )
    return report


def refusal_hint(errors: list[str]) -> str | None:
    """What to do when the server refused the priorities (an ``fcfs`` server), else None."""
    if any("scheduling_policy" in e or "priority" in e for e in errors):
        return (
            "the server refused the requests' priorities: --priority-mix needs a server started with "
            "--scheduling-policy priority."
        )
    return None


def print_priority_report(report: dict[str, Any]) -> None:
    rows = []
    for name in ("high", "low"):
        c = report[name]
        d = c["ttft_ms"]
        rows.append([f"{name} (priority {c['priority']})", c["completed"], d["median"], d["p90"], d["p99"]])
    print()
    print(format_table(["TTFT ms", "completed", "median", "p90", "p99"], rows))
    parts = [
        f"{p} {value:.2f}" if (value := report[f"ttft_{p}_ratio"]) is not None else f"{p} n/a"
        for p in RATIO_PERCENTILES
    ]
    print(
        f"High/low TTFT ratio: {', '.join(parts)} (the first high-priority request went out at "
        f"{report['high_first_sent_s']:.2f} s, with {report['low_streaming_at_first_high']} low-priority "
        "requests streaming)"
    )


__all__ = [
    "HIGH_PRIORITY",
    "LOW_PRIORITY",
    "PriorityMix",
    "parse_priority_mix",
    "print_priority_report",
    "priority_report",
    "refusal_hint",
]
