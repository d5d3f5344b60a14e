"""The table printed at the end of a run: a few figures of each section (the JSON has them all)."""

from __future__ import annotations

import math
from typing import Any

from pagedllm_bench.common import format_table
from sections import quantization, swap


def fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def summary_table(results: dict[str, Any]) -> str:
    """The summary of ``results`` as a table of section, metric and value."""
    return format_table(["section", "metric", "value"], summary_rows(results), left_columns=2)


def summary_rows(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []

    def status(sec: dict[str, Any] | None) -> str:
        if sec is None:
            return "not run"
        if "passed" in sec:
            return "passed" if sec["passed"] else "FAILED"
        return str(sec.get("status", "ok"))

    k = results.get("kernels")
    rows.append(
        (
            "kernels",
            "cases passed",
            f"{k['num_passed']}/{k['num_cases']}" if k and "num_cases" in k else status(k),
        )
    )
    thresholds = (
        next((c for c in k.get("cases", []) if c["name"] == "top-k/top-p thresholds"), None) if k else None
    )
    if thresholds and "filter_ms" in thresholds:
        rows.append(
            ("kernels", f"top-k/top-p filter ms ({thresholds['rows']} rows)", fmt(thresholds["filter_ms"], 3))
        )
        rows.append(
            (
                "kernels",
                "syncs sampling top-k/top-p rows",
                str(thresholds["sampler_syncs"].get("count", thresholds["sampler_syncs"].get("error"))),
            )
        )
    e = results.get("equivalence")
    if e and "vs_hf" in e:
        v = e["vs_hf"]
        rows.append(
            (
                "equivalence",
                "vs HF identical/near-tie/mismatch",
                f"{v['identical']}/{v['near_tie']}/{v['mismatch']}",
            )
        )
        g = e["graphs_vs_eager"]
        rows.append(
            (
                "equivalence",
                "graphs vs eager identical/near-tie/mismatch",
                f"{g['identical']}/{g['near_tie']}/{g['mismatch']}"
                if "identical" in g
                else g.get("status", "-"),
            )
        )
    else:
        rows.append(("equivalence", "status", status(e) + (f" ({e.get('reason', '')[:60]})" if e else "")))
    t = results.get("throughput")
    if t and "engine" in t:
        rows.append(
            (
                "startup",
                "engine start-up s (graph capture s)",
                f"{fmt(t['startup_s'])} ({fmt(t.get('cuda_graph_capture_s'))})",
            )
        )
        rows.append(
            (
                "throughput",
                f"pagedllm output tok/s ({t['engine']['num_requests']} req)",
                fmt(t["engine"]["output_tokens_per_s"]),
            )
        )
        if "engine_again" in t:
            rows.append(
                (
                    "throughput",
                    "pagedllm output tok/s, second run",
                    fmt(t["engine_again"]["output_tokens_per_s"]),
                )
            )
        for b in t["engine"].get("steps_by_running", []):
            rows.append(
                (
                    "throughput",
                    f"steps ({b['running']}): count, s, ms/step",
                    f"{b['steps']}, {fmt(b['seconds'], 2)}, {fmt(b['ms_per_step'], 2)}",
                )
            )
    else:
        rows.append(("throughput", "status", status(t)))
    h = results.get("hf")
    if h and "hf" in h:
        rows.append(
            (
                "hf",
                f"HF continuous batching output tok/s ({h['hf']['completed_requests']}/{h['hf']['num_requests']} req)",
                fmt(h["hf"]["output_tokens_per_s"]),
            )
        )
        rows.append(
            (
                "hf",
                f"pagedllm on the same {h['engine']['num_requests']} req, tok/s",
                fmt(h["engine"]["output_tokens_per_s"]),
            )
        )
        rows.append(("hf", "speedup (same requests)", fmt(h.get("speedup"), 2) + "x"))
    else:
        rows.append(("hf", "status", status(h)))
    d = results.get("decode")
    if d and "step_ms" in d:
        rows.append(
            (
                "decode",
                f"step ms @{d['num_running']} running (sync / ahead / instrumented)",
                f"{fmt(d['sync_step_ms'], 2)} / {fmt(d['async_step_ms'], 2)} / {fmt(d['step_ms'], 2)}",
            )
        )
        rows.append(
            (
                "decode",
                "forward / prepare / sample / other ms",
                " / ".join(
                    fmt(d[key], 2) for key in ("forward_ms", "prepare_ms", "sample_ms", "other_host_ms")
                ),
            )
        )
        rows.append(
            (
                "decode",
                "CPU-side share of step (sync / ahead)",
                f"{fmt(100 * d['sync_overhead_fraction'])}% / {fmt(100 * d['async_overhead_fraction'])}%",
            )
        )
        syncs = d.get("launch_sync_warnings")
        if syncs:
            rows.append(
                ("decode", "synchronising calls in launches", f"{syncs['warnings']} in {syncs['launches']}")
            )
    else:
        rows.append(("decode", "status", status(d)))
    r = results.get("roofline")
    if r and "bytes_per_step" in r:
        rows.append(("roofline", "bytes per decode step (GB)", fmt(r["bytes_per_step"] / 1e9, 3)))
        rows.append(("roofline", "copy bandwidth (GB/s)", fmt(r["copy_bandwidth_GBps"])))
        rows.append(
            (
                "roofline",
                "roofline fraction (forward / whole step)",
                f"{fmt(100 * r['fraction_of_roofline_forward'])}% / {fmt(100 * r['fraction_of_roofline_step'])}%",
            )
        )
    if r and "workload" in r:
        w = r["workload"]
        rows.append(
            (
                "roofline",
                "workload: ideal s (decode + prefill) / measured s",
                f"{fmt(w['ideal_decode_s'], 2)} + {fmt(w['ideal_prefill_s'], 2)} / {fmt(w['measured_s'], 2)}",
            )
        )
        rows.append(("roofline", "workload roofline fraction", f"{fmt(100 * w['fraction_of_roofline'])}%"))
    if not r or "bytes_per_step" not in r:
        rows.append(("roofline", "status", status(r)))
    sv = results.get("serve")
    if sv and "server" in sv:
        rows.append(
            (
                "serve",
                f"streamed server / offline tok/s ({sv['num_requests']} req)",
                f"{fmt(sv['server']['output_tokens_per_s'])} / {fmt(sv['offline']['output_tokens_per_s'])}"
                f" = {fmt(100 * sv['server_over_offline'])}%",
            )
        )
        rows.append(("serve", "server ms per step", fmt(sv["server"]["ms_per_step"], 2)))
    else:
        rows.append(("serve", "status", status(sv)))
    sp = results.get("serve_processes")
    if sp and "runs_by_api_server_count" in sp:
        for count, run in sp["runs_by_api_server_count"].items():
            rows.append(
                (
                    "serve_processes",
                    f"pagedllm serve, {count} front-end(s) / offline tok/s",
                    f"{fmt(run['output_tokens_per_s'])} / {fmt(sp['offline_output_tokens_per_s'])}"
                    f" = {fmt(100 * run['server_over_offline'])}%",
                )
            )
    else:
        rows.append(("serve_processes", "status", status(sp)))
    rows += quantization.summary_rows(results.get("quantization"))
    rows += swap.summary_rows(results.get("swap"))
    rows += failure_rows(results)
    rows.append(("overall", "checks", "passed" if results.get("passed") else "FAILED"))
    return rows


def failure_rows(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """One row per failed or broken section, saying why as far as the section does."""
    rows = []
    for name, sec in results.items():
        if not isinstance(sec, dict) or not (sec.get("passed") is False or sec.get("status") == "error"):
            continue
        reasons = [str(sec["error"])] if sec.get("error") else []
        reasons += [f"case {c}" for c in sec.get("failed", []) if isinstance(c, str)]
        for part, sub in sec.items():
            if isinstance(sub, dict) and sub.get("passed") is False:
                why = sub.get("error") or (f"{sub['mismatch']} mismatches" if "mismatch" in sub else "failed")
                reasons.append(f"{part}: {why}")
        for count, run in sec.get("runs_by_api_server_count", {}).items():
            reasons += [f"{count} front-end(s): {p}" for p in run.get("problems", [])]
        rows.append((name, "FAILED", "; ".join(reasons)[:300] or "see the JSON"))
    return rows
