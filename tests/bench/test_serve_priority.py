"""``pagedllm bench serve --priority-mix LOW:HIGH``: the low-priority requests go out first and the
high-priority ones only once every low one streams; the report gives each class's TTFT and the
high/low ratio of their p50 and p90, computed from those figures; a server that refuses priorities
(``fcfs``) fails the run with the flag to start it with."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers.model_factory import make_tiny_hf_model
from helpers.server import RemoteServer
from pagedllm.entrypoints.cli import main
from pagedllm_bench.serve_client import RequestResult
from pagedllm_bench.serve_priority import (
    HIGH_PRIORITY,
    LOW_PRIORITY,
    PriorityMix,
    parse_priority_mix,
    priority_report,
    refusal_hint,
)

WORKLOAD = ["--input-len", "8:16", "--output-len", "24:32", "--seed", "3"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_hf_model(tmp_path_factory.mktemp("serve_priority"), "llama")


@pytest.fixture(scope="module")
def priority_server(tiny: str) -> Iterator[RemoteServer]:
    args = [tiny, "--scheduling-policy", "priority", "--max-num-seqs", "4", "--num-kv-blocks", "32"]
    with RemoteServer([*args, "--max-model-len", "256"]) as srv:
        yield srv
        srv.wait_idle()


def result(index: int, priority: int, start: float, ttft: float, latency: float = 1.0) -> RequestResult:
    return RequestResult(
        index,
        8,
        4,
        success=True,
        priority=priority,
        start=start,
        ttft=ttft,
        latency=latency,
        output_tokens=4,
        chunk_times=[start + ttft],
        chunk_tokens=[1],
    )


def test_priority_report_per_class_and_ratio() -> None:
    lows = [result(i, LOW_PRIORITY, 0.0, 0.1 * (i + 1), latency=2.0) for i in range(10)]
    lows[0].latency = 0.5  # ended before the first high-priority request went out
    highs = [result(10 + i, HIGH_PRIORITY, 1.0 + 0.1 * i, 0.01 * (i + 1)) for i in range(5)]
    failed = RequestResult(15, 8, 4, error="boom", priority=HIGH_PRIORITY, start=2.0)
    report = priority_report([*lows, *highs, failed], PriorityMix(10, 6))
    low, high = report["low"], report["high"]
    assert (low["priority"], low["requests"], low["completed"]) == (LOW_PRIORITY, 10, 10)
    assert (high["priority"], high["requests"], high["completed"]) == (HIGH_PRIORITY, 6, 5)
    for cls in (low, high):
        assert {"p50", "p90", "median", "mean", "p99"} <= set(cls["ttft_ms"])
    # numpy's linear percentiles of 100..1000 ms and 10..50 ms.
    assert low["ttft_ms"]["p90"] == pytest.approx(910.0)
    assert high["ttft_ms"]["p90"] == pytest.approx(46.0)
    assert report["ttft_p90_ratio"] == pytest.approx(high["ttft_ms"]["p90"] / low["ttft_ms"]["p90"])
    assert report["ttft_p50_ratio"] == pytest.approx(high["ttft_ms"]["p50"] / low["ttft_ms"]["p50"])
    assert report["high_first_sent_s"] == 1.0
    assert report["low_streaming_at_first_high"] == 9
    assert (report["low_requests"], report["high_requests"]) == (10, 6)
    # No completed high-priority request: no ratio.
    assert priority_report(lows, PriorityMix(10, 1))["ttft_p90_ratio"] is None


def test_parse_priority_mix_and_refusal_hint() -> None:
    assert parse_priority_mix("64:16") == PriorityMix(64, 16)
    assert PriorityMix(2, 1).priorities() == [LOW_PRIORITY, LOW_PRIORITY, HIGH_PRIORITY]
    assert parse_priority_mix(None) is None
    for bad in ("64", "0:4", "4:0", "a:b", "1:2:3", "-1:4"):
        with pytest.raises(ValueError, match="--priority-mix must be LOW:HIGH"):
            parse_priority_mix(bad)
    hint = refusal_hint(["HTTP 400: priority 1: requests have priorities under scheduling_policy ..."])
    assert hint is not None and "--scheduling-policy priority" in hint
    assert refusal_hint(["HTTP 503: overloaded"]) is None


def test_priority_mix_refuses_max_concurrency() -> None:
    argv = [
        "bench",
        "serve",
        "--base-url",
        "http://127.0.0.1:9",
        "--priority-mix",
        "4:2",
        "--max-concurrency",
        "2",
    ]
    assert main(argv) == 2


def _read(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def test_priority_mix_against_a_priority_server(priority_server: RemoteServer, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--base-url", priority_server.base_url, "--priority-mix", "4:3", *WORKLOAD]
    assert main([*argv, "--request-rate", "200", "--output-json", str(out)]) == 0, priority_server.log_tail()
    data = _read(out)
    assert data["completed"] == 7 and data["failed"] == 0
    mix = data["priority_mix"]
    assert (mix["low"]["completed"], mix["high"]["completed"]) == (4, 3)
    for name in ("low", "high"):
        assert mix[name]["ttft_ms"]["p50"] > 0 and mix[name]["ttft_ms"]["p90"] > 0
    assert mix["ttft_p90_ratio"] == pytest.approx(
        mix["high"]["ttft_ms"]["p90"] / mix["low"]["ttft_ms"]["p90"]
    )
    assert mix["ttft_p50_ratio"] == pytest.approx(
        mix["high"]["ttft_ms"]["p50"] / mix["low"]["ttft_ms"]["p50"]
    )
    records = data["requests"]
    assert [r["priority"] for r in records] == [LOW_PRIORITY] * 4 + [HIGH_PRIORITY] * 3
    # The high-priority requests went out once every low-priority one was streaming.
    low_streaming = max(r["start_s"] + r["ttft_s"] for r in records[:4])
    assert all(r["start_s"] >= low_streaming for r in records[4:])
    assert mix["high_first_sent_s"] == pytest.approx(min(r["start_s"] for r in records[4:]))
    assert not math.isnan(mix["high_first_sent_s"])
    priority_server.wait_idle()


def test_priority_mix_against_an_fcfs_server(
    tiny: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with RemoteServer([tiny, "--no-multiprocess", "--num-kv-blocks", "32", "--max-model-len", "256"]) as srv:
        argv = ["bench", "serve", "--base-url", srv.base_url, "--priority-mix", "2:1", *WORKLOAD]
        with caplog.at_level(logging.ERROR, logger="pagedllm_bench"):
            assert main([*argv, "--output-json", str(tmp_path / "serve.json")]) == 1
        srv.wait_idle()
    assert "--scheduling-policy priority" in caplog.text
    assert not (tmp_path / "serve.json").exists()
