"""The benchmarks: each ``pagedllm bench`` command once on a tiny workload, through the CLI entry point,
checking the documented JSON fields; plus the pure functions (workloads, arrivals, SLOs, statistics)."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import cached_checkpoint

from helpers.server import RemoteServer
from pagedllm.entrypoints.cli import main
from pagedllm_bench import baselines, roofline, throughput
from pagedllm_bench.common import distribution
from pagedllm_bench.serve_client import RequestResult, arrival_offsets
from pagedllm_bench.serve_report import parse_slo, summarize
from pagedllm_bench.workloads import parse_range, prefix_workload, random_workload

TINY_ENGINE = ["--num-kv-blocks", "64", "--max-model-len", "256"]
TINY_WORKLOAD = ["--num-prompts", "3", "--input-len", "8:16", "--output-len", "2:4"]
DIST_KEYS = {"mean", "median", "p50", "p90", "p99", "min", "max", "std"}
THROUGHPUT_KEYS = {"requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "elapsed_s"}


def _read(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


@pytest.fixture(scope="module")
def roofline_json(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("roofline") / "roofline.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("pagedllm.model.loader.load_checkpoint", cached_checkpoint)
        args = ["bench", "roofline", "--gemm-tokens", "1,8", "--bandwidth-mib", "16", "--repeats", "1"]
        assert main([*args, "--batch-sizes", "1,4", "--output-json", str(out)]) == 0
    yield out


# ------------------------------------------------------------------------------------------------
# Commands
# ------------------------------------------------------------------------------------------------


def test_roofline(roofline_json: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _read(roofline_json)
    for key in ("date", "machine", "model", "gemm", "gemm_flops_per_s", "memory_bandwidth_bytes_per_s"):
        assert key in data
    assert {"cpu_count", "torch_num_threads", "torch_version"} <= set(data["machine"])
    model = data["model"]
    # SmolLM2-135M: tied embeddings, so the LM head is counted among the matrix-product weights.
    assert 130e6 < model["num_params"] < 140e6
    assert model["matmul_params"] <= model["num_params"]
    assert model["weight_bytes"] >= 4 * model["matmul_params"]
    assert model["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    assert [g["tokens"] for g in data["gemm"]] == [1, 8]
    assert all(g["flops_per_s"] > 0 for g in data["gemm"])
    assert data["memory_bandwidth_bytes_per_s"] > 0
    assert [d["batch"] for d in data["decode_floors"]] == [1, 4]
    for d in data["decode_floors"]:
        assert d["step_floor_s"] == max(d["memory_s"], d["compute_s"]) > 0
        assert d["tokens_per_s_ceiling"] == pytest.approx(d["batch"] / d["step_floor_s"])
    assert data["prefill_floor_s_per_token"] > 0


def test_throughput_random_with_baselines(
    tmp_path: Path,
    roofline_json: Path,
    hf_default: tuple[Any, Any],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(baselines, "load_hf_model", lambda model, device="cpu": hf_default[0])
    out = tmp_path / "throughput.json"
    argv = ["bench", "throughput", *TINY_WORKLOAD, *TINY_ENGINE, "--baseline", "hf-static,hf-cb"]
    argv += ["--baseline-batch-size", "2", "--roofline-json", str(roofline_json), "--output-json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "hf-static" in printed and "output tok/s" in printed

    data = _read(out)
    for key in ("date", "machine", "workload", "engine_config", "engine", "baselines", "ratios", "roofline"):
        assert key in data, key
    assert {"cpu_count", "torch_num_threads", "torch_version"} <= set(data["machine"])
    assert data["peak_rss_mib"] > 0
    assert data["engine_config"]["num_kv_blocks"] == 64 and data["engine_config"]["max_model_len"] == 256
    workload = data["workload"]
    assert workload["num_requests"] == 3
    assert 8 <= workload["prompt_len_min"] <= workload["prompt_len_max"] <= 16

    engine = data["engine"]
    assert THROUGHPUT_KEYS <= set(engine)
    assert engine["num_requests"] == 3
    # ignore_eos: every request produced exactly its output length.
    assert engine["output_tokens"] == engine["requested_output_tokens"] == workload["num_output_tokens"]
    assert DIST_KEYS <= set(engine["ttft_s"]) and engine["ttft_s"]["p50"] > 0
    assert engine["num_preemptions"] == 0
    assert 0.0 <= engine["prefix_cache_hit_rate"] <= 1.0
    kv = engine["kv_cache"]
    assert 0 <= kv["waste_slots_mean_per_running_request"] <= kv["waste_slots_max_per_running_request"] < 16
    assert 0 < kv["peak_kv_cache_usage"] <= 1
    # The engine ran before and after the baselines; the reported time is the mean of both runs.
    runs = engine["runs"]
    assert len(runs) == 2 and all(r["elapsed_s"] > 0 for r in runs)
    assert engine["elapsed_s"] == pytest.approx((runs[0]["elapsed_s"] + runs[1]["elapsed_s"]) / 2)
    assert engine["output_tokens_per_s"] == pytest.approx(engine["output_tokens"] / engine["elapsed_s"])
    assert "before and after the baselines" in printed

    for name in ("hf-static", "hf-cb"):
        base = data["baselines"][name]
        assert "error" not in base, base
        assert THROUGHPUT_KEYS <= set(base)
        # Only the requested tokens count, although static batches generate their longest length.
        assert base["output_tokens"] == workload["num_output_tokens"]
        ratios = data["ratios"][name]
        assert ratios["output_tokens_per_s"] == pytest.approx(
            engine["output_tokens_per_s"] / base["output_tokens_per_s"]
        )
    assert data["baselines"]["hf-static"]["computed_output_tokens"] >= workload["num_output_tokens"]

    roof = data["roofline"]
    assert roof["time_floor_s"] == max(roof["compute_floor_s"], roof["memory_floor_s"]) > 0
    assert roof["compute_floor_s"] == pytest.approx(roof["gemm_floor_s"] + roof["attention_floor_s"])
    assert roof["attention_floor_s"] > 0
    assert roof["fraction_of_roofline"] == pytest.approx(roof["time_floor_s"] / engine["elapsed_s"])


def test_throughput_measures_roofline_in_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    measured: list[str] = []

    def small_roofline(config: Any, name: str, dtype: str) -> dict[str, Any]:
        measured.append(dtype)  # the real measurement, at fewer row counts and a smaller copy
        return roofline.measure_roofline(config, name, dtype, (1, 8), 16, 1)

    monkeypatch.setattr(throughput, "measure_roofline", small_roofline)
    out = tmp_path / "throughput.json"
    argv = ["bench", "throughput", *TINY_WORKLOAD, *TINY_ENGINE, "--no-warmup", "--measure-roofline"]
    assert main([*argv, "--output-json", str(out)]) == 0
    assert measured == ["float32"]
    roof = _read(out)["roofline"]
    assert roof["source"] == "measured in this run"
    assert [g["tokens"] for g in roof["measured"]["gemm"]] == [1, 8]
    assert roof["measured"]["memory_bandwidth_bytes_per_s"] > 0
    assert roof["fraction_of_roofline"] == pytest.approx(
        roof["time_floor_s"] / _read(out)["engine"]["elapsed_s"]
    )
    # A file and a measurement at once is refused before anything runs.
    assert main([*argv, "--roofline-json", str(out)]) == 2
    assert measured == ["float32"]


def test_throughput_prefix_compare_caching(tmp_path: Path) -> None:
    out = tmp_path / "prefix.json"
    argv = ["bench", "throughput", "--workload", "prefix", "--num-prompts", "4", "--prefix-len", "48"]
    argv += ["--suffix-len", "2:4", "--output-len", "2:3", *TINY_ENGINE, "--compare-prefix-caching"]
    # A small token budget admits the requests over several steps, so later ones find the prefix cached.
    argv += ["--max-num-batched-tokens", "64", "--no-warmup", "--output-json", str(out)]
    assert main(argv) == 0
    data = _read(out)
    assert data["workload"]["name"] == "prefix" and data["workload"]["prefix_len"] == 48
    on = data["systems"]["pagedllm"]
    off = data["systems"]["pagedllm-prefix-caching-off"]
    assert on["engine_config"]["enable_prefix_caching"] and not off["engine_config"]["enable_prefix_caching"]
    assert on["prefix_cache_hit_rate"] > 0 and off["prefix_cache_hit_rate"] == 0
    assert on["prompt_tokens_computed"] < off["prompt_tokens_computed"]
    cmp = data["prefix_caching_comparison"]
    assert cmp["ttft_p50_on_s"] == on["ttft_s"]["p50"] and cmp["ttft_p50_off_s"] == off["ttft_s"]["p50"]
    assert cmp["ttft_p50_ratio_off_over_on"] == pytest.approx(cmp["ttft_p50_off_s"] / cmp["ttft_p50_on_s"])
    assert cmp["ttft_p90_on_s"] >= cmp["ttft_p50_on_s"]


def test_throughput_dataset(tmp_path: Path) -> None:
    dataset = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "The capital of France is", "output_len": 3}, {"prompt": [1, 2, 3, 4, 5]}]
    dataset.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "dataset.json"
    argv = ["bench", "throughput", "--dataset", str(dataset), "--output-len", "2", *TINY_ENGINE]
    assert main([*argv, "--no-warmup", "--output-json", str(out)]) == 0
    data = _read(out)
    assert data["workload"]["name"] == "dataset" and data["workload"]["num_requests"] == 2
    assert data["engine"]["output_tokens"] == 5
    assert data["warmup"] is False


def test_step_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "step.json"
    argv = [
        "bench",
        "step",
        "--batch-size",
        "4",
        "--context-len",
        "20",
        "--steps",
        "3",
        "--warmup-steps",
        "1",
    ]
    assert main([*argv, *TINY_ENGINE, "--output-json", str(out)]) == 0
    data = _read(out)
    assert data["batch_size"] == 4 and data["steps"] == 3
    phases = data["phases_s"]
    assert set(phases) == {"schedule", "prepare", "forward", "sample", "outputs", "record", "other"}
    assert min(phases.values()) >= 0 and phases["forward"] > 0
    timed = sum(v for k, v in phases.items() if k != "other")
    assert timed <= data["step_s"] * 1.001
    assert data["overhead_s"] == pytest.approx(data["step_s"] - phases["forward"])
    assert "Overhead outside the model forward" in capsys.readouterr().out
    assert main(["bench", "step", "--batch-size", "0", *TINY_ENGINE]) == 2


def test_throughput_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "throughput", *TINY_WORKLOAD, *TINY_ENGINE, "--baseline", "hf-nope"]) == 2
    with pytest.raises(SystemExit):
        main(["bench", "throughput", "--input-len", "9:3"])
    too_long = ["--num-prompts", "2", "--input-len", "200:250", "--output-len", "100"]
    assert main(["bench", "throughput", *too_long, *TINY_ENGINE]) == 2


def test_serve_against_a_real_server(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    plots = tmp_path / "plots"
    with RemoteServer([*TINY_ENGINE]) as server:
        argv = ["bench", "serve", "--base-url", server.base_url, "--num-prompts", "4", "--input-len", "8:16"]
        argv += [
            "--output-len",
            "2:4",
            "--max-concurrency",
            "2",
            "--request-rate",
            "50",
            "--burstiness",
            "0.5",
        ]
        argv += ["--slo", "ttft:60000,tpot:60000", "--compare-offline", *TINY_ENGINE]
        argv += ["--output-json", str(out), "--plot-dir", str(plots)]
        assert main(argv) == 0, server.log_tail()
    data = _read(out)
    assert data["completed"] == 4 and data["failed"] == 0
    assert (
        data["total_output_tokens"]
        == data["requested_output_tokens"]
        == data["workload"]["num_output_tokens"]
    )
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "duration_s"):
        assert data[key] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert {"mean", "median", "p90", "p99"} <= set(data[key])
        assert data[key]["median"] > 0
    assert data["good_requests"] == 4 and data["goodput"] == pytest.approx(4 / data["duration_s"])
    assert data["load"]["max_concurrency"] == 2 and data["load"]["burstiness"] == 0.5
    assert {"cpu_count", "torch_num_threads", "torch_version"} <= set(data["machine"])
    assert len(data["requests"]) == 4
    for r in data["requests"]:
        assert r["success"] and r["e2el_s"] >= r["ttft_s"] > 0
        assert r["output_tokens"] == r["requested_output_len"]
    assert sum(
        t * data["timeline"]["bin_s"] for t in data["timeline"]["output_tokens_per_s"]
    ) == pytest.approx(data["total_output_tokens"])
    offline = data["offline"]
    assert offline["max_num_seqs"] == 2  # capped at --max-concurrency, as the server's clients were
    assert offline["total_output_tokens"] == data["total_output_tokens"]
    assert offline["server_output_throughput_pct"] == pytest.approx(
        100 * data["output_throughput"] / offline["output_throughput"]
    )
    for name in ("latency_cdf.png", "throughput_over_time.png"):
        png = plots / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serve_reports_an_unreachable_server(tmp_path: Path) -> None:
    argv = ["bench", "serve", "--base-url", "http://127.0.0.1:9", *TINY_WORKLOAD, "--timeout", "5"]
    assert main(argv) == 1


# ------------------------------------------------------------------------------------------------
# Pure functions
# ------------------------------------------------------------------------------------------------


def test_parse_range() -> None:
    assert parse_range("7") == (7, 7)
    assert parse_range("32:256") == (32, 256)
    for bad in ("0", "5:4", "a", "1:2:3"):
        with pytest.raises(Exception, match="expected"):
            parse_range(bad)


def test_workloads_are_deterministic_and_in_range() -> None:
    a = random_workload(20, (4, 9), (2, 5), vocab_size=100, seed=3, exclude_token_ids=[0, 1, 2])
    b = random_workload(20, (4, 9), (2, 5), vocab_size=100, seed=3, exclude_token_ids=[0, 1, 2])
    assert [r.prompt_token_ids for r in a.requests] == [r.prompt_token_ids for r in b.requests]
    assert all(4 <= r.prompt_len <= 9 and 2 <= r.output_len <= 5 for r in a.requests)
    assert all(3 <= t < 100 for r in a.requests for t in r.prompt_token_ids)
    p = prefix_workload(5, 32, (1, 3), (2, 2), vocab_size=100, seed=0)
    prefix = p.requests[0].prompt_token_ids[:32]
    assert all(r.prompt_token_ids[:32] == prefix and 33 <= r.prompt_len <= 35 for r in p.requests)
    assert p.summary()["num_output_tokens"] == 10


def test_arrivals_and_slo() -> None:
    assert arrival_offsets(5, math.inf, 1.0, 0) == [0.0] * 5
    offsets = arrival_offsets(4000, 20.0, 1.0, 0)
    assert offsets == sorted(offsets) and offsets[0] == 0.0
    assert offsets[-1] / len(offsets) == pytest.approx(1 / 20.0, rel=0.1)
    assert parse_slo("ttft:500,tpot:50") == {"ttft": 0.5, "tpot": 0.05}
    with pytest.raises(ValueError, match="METRIC"):
        parse_slo("latency:5")


def test_summarize_goodput_and_distribution() -> None:
    fast = RequestResult(0, 10, 3, success=True, ttft=0.1, latency=0.3, output_tokens=3, itl=[0.1, 0.1])
    slow = RequestResult(1, 10, 3, success=True, ttft=2.0, latency=2.2, output_tokens=3, itl=[0.1, 0.1])
    failed = RequestResult(2, 10, 3, error="boom")
    m = summarize([fast, slow, failed], 2.0, {"ttft": 1.0})
    assert m["completed"] == 2 and m["failed"] == 1 and m["errors"] == ["boom"]
    assert m["good_requests"] == 1 and m["goodput"] == 0.5
    assert m["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert m["output_throughput"] == 3.0
    d = distribution([1.0, 2.0, 3.0, 4.0])
    assert d["median"] == d["p50"] == 2.5 and d["max"] == 4.0
    assert math.isnan(distribution([])["mean"])


def test_bench_without_the_benchmarks_package_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The runtime runs without ``pagedllm_bench``; ``pagedllm bench`` then exits 2 with the remedy."""
    monkeypatch.setitem(sys.modules, "pagedllm_bench.cli", None)
    monkeypatch.setitem(sys.modules, "pagedllm_bench", None)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "throughput"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "pagedllm_bench is not installed" in err and "pip install -e ./benchmarks" in err, err
