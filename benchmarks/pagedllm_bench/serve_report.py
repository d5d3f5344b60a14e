"""The report of ``pagedllm bench serve``: service-level objectives, the run's aggregate metrics
(throughput, latency distributions, goodput), per-request records, its token timeline, plots and the
printed summary."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pagedllm_bench.common import distribution, format_table, ratio
from pagedllm_bench.serve_client import RequestResult

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "itl", "e2el")


def parse_slo(text: str | None) -> dict[str, float]:
    """``"ttft:500,tpot:50"`` (milliseconds) -> ``{"ttft": 0.5, "tpot": 0.05}`` (seconds)."""
    if not text:
        return {}
    slo: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(
                f"--slo entries must be METRIC:MS with METRIC in {', '.join(SLO_METRICS)}; got {part!r}."
            )
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--slo {name}: {value!r} is not a number of milliseconds.") from None
        if ms <= 0:
            raise ValueError(f"--slo {name} must be positive, got {value}.")
        slo[name] = ms / 1000.0
    return slo


def summarize(results: list[RequestResult], duration: float, slo: dict[str, float]) -> dict[str, Any]:
    """Aggregate metrics of a run: throughput, latency distributions (ms) and goodput."""
    ok = [r for r in results if r.success]
    duration = max(duration, 1e-9)
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)

    def ms(values: list[float]) -> dict[str, float]:
        return {k: v * 1e3 for k, v in distribution(values, PERCENTILES).items()}

    ttft = [r.ttft for r in ok]
    tpot = [r.tpot for r in ok if not math.isnan(r.tpot)]
    itl = [x for r in ok for x in r.itl]
    e2el = [r.latency for r in ok]
    good = 0
    for r in ok:
        values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency, "itl": max(r.itl, default=0.0)}
        if all(not (values[k] > limit) for k, limit in slo.items()):
            good += 1
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:10],
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "requested_output_tokens": sum(r.requested_output_len for r in ok),
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": ms(ttft),
        "tpot_ms": ms(tpot),
        "itl_ms": ms(itl),
        "e2el_ms": ms(e2el),
        "slo_ms": {k: v * 1e3 for k, v in slo.items()},
        "good_requests": good if slo else None,
        "goodput": good / duration if slo else None,
    }


def request_records(results: list[RequestResult]) -> list[dict[str, Any]]:
    """Each request's outcome and timings (seconds), for the JSON results."""
    return [
        {
            "index": r.index,
            "priority": r.priority,
            "success": r.success,
            "error": r.error or None,
            "prompt_len": r.prompt_len,
            "requested_output_len": r.requested_output_len,
            "output_tokens": r.output_tokens,
            "start_s": r.start,
            "ttft_s": r.ttft,
            "tpot_s": r.tpot,
            "e2el_s": r.latency,
            "num_chunks": len(r.chunk_times),
        }
        for r in results
    ]


def token_timeline(results: list[RequestResult], duration: float, bin_s: float) -> dict[str, Any]:
    """Output tokens/s and the mean number of requests in flight in each ``bin_s``-second bin."""
    nbins = max(1, math.ceil(duration / bin_s))
    tokens = np.zeros(nbins)
    in_flight = np.zeros(nbins)
    for r in results:
        prev = 0
        for t, cum in zip(r.chunk_times, r.chunk_tokens, strict=True):
            tokens[min(int(t / bin_s), nbins - 1)] += cum - prev
            prev = cum
        if r.success:
            # Time-weighted: the fraction of each bin the request spent in flight.
            end = r.start + r.latency
            for b in range(int(r.start / bin_s), min(int(end / bin_s), nbins - 1) + 1):
                overlap = min(end, (b + 1) * bin_s) - max(r.start, b * bin_s)
                in_flight[b] += max(0.0, overlap) / bin_s
    return {
        "bin_s": bin_s,
        "time_s": [(i + 0.5) * bin_s for i in range(nbins)],
        "output_tokens_per_s": list(tokens / bin_s),
        "requests_in_flight": list(in_flight),
    }


def write_plots(
    results: list[RequestResult], timeline: dict[str, Any], plot_dir: str, title: str
) -> list[str]:
    """Latency CDFs and output tokens/s over time as PNG files in ``plot_dir``; returns their paths."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(plot_dir, exist_ok=True)
    ok = [r for r in results if r.success]
    series = {
        "TTFT": [r.ttft * 1e3 for r in ok],
        "TPOT": [r.tpot * 1e3 for r in ok if not math.isnan(r.tpot)],
        "ITL": [x * 1e3 for r in ok for x in r.itl],
        "End-to-end latency": [r.latency * 1e3 for r in ok],
    }
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, values) in zip(axes.flat, series.items(), strict=True):
        if values:
            xs = np.sort(np.asarray(values))
            ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post")
            for p in PERCENTILES:
                ax.axvline(float(np.percentile(xs, p)), linestyle=":", linewidth=0.8, color="gray")
        ax.set_title(name)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of chunks")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Latency CDFs: {title}")
    fig.tight_layout()
    cdf_path = os.path.join(plot_dir, "latency_cdf.png")
    fig.savefig(cdf_path, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.plot(
        timeline["time_s"], timeline["output_tokens_per_s"], drawstyle="steps-mid", label="output tokens/s"
    )
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(
        timeline["time_s"],
        timeline["requests_in_flight"],
        drawstyle="steps-mid",
        color="tab:orange",
        alpha=0.7,
        label="requests in flight (mean over the bin)",
    )
    ax2.set_ylabel("requests in flight")
    ax2.set_ylim(bottom=0)
    ax.set_title(f"Throughput over time: {title}")
    lines = ax.get_lines() + ax2.get_lines()
    ax.legend(lines, [str(line.get_label()) for line in lines], loc="lower right", fontsize="small")
    fig.tight_layout()
    tps_path = os.path.join(plot_dir, "throughput_over_time.png")
    fig.savefig(tps_path, dpi=100)
    plt.close(fig)
    return [cdf_path, tps_path]


def percent_of(a: float, b: float) -> float | None:
    """``a`` as a percentage of ``b`` (None when ``b`` is zero or either is missing)."""
    r = ratio(a, b)
    return None if r is None else 100.0 * r


def print_report(metrics: dict[str, Any], offline: dict[str, Any] | None, plots: list[str]) -> None:
    print()
    print(
        f"Completed {metrics['completed']} requests ({metrics['failed']} failed) in {metrics['duration_s']:.2f} s"
    )
    for err in metrics["errors"]:
        print(f"  error: {err}")
    print(
        f"Request throughput {metrics['request_throughput']:.2f} req/s, output {metrics['output_throughput']:.1f} "
        f"tok/s, total {metrics['total_token_throughput']:.1f} tok/s"
    )
    if metrics["goodput"] is not None:
        print(f"Goodput {metrics['goodput']:.2f} req/s ({metrics['good_requests']} requests within the SLO)")
    rows = []
    for key, name in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2el_ms", "E2E latency"),
    ):
        d = metrics[key]
        rows.append([name, d["mean"], d["median"], d["p90"], d["p99"]])
    print()
    print(format_table(["ms", "mean", "median", "p90", "p99"], rows))
    if offline is not None:
        pct = offline["server_output_throughput_pct"]
        print(
            f"\nOffline LLM.generate (max_num_seqs {offline['max_num_seqs']}): "
            f"{offline['output_throughput']:.1f} output tok/s; the server reaches "
            + (f"{pct:.1f}% of it" if pct is not None else "an unknown fraction of it")
        )
        median = offline.get("median_server_output_throughput_pct")
        if median is not None and len(offline.get("pairs", [])) > 1:
            shares = ", ".join(f"{p['server_output_throughput_pct']:.1f}%" for p in offline["pairs"])
            print(f"Median over {len(offline['pairs'])} pairs: {median:.1f}% ({shares})")
    for path in plots:
        print(f"Plot: {path}")
