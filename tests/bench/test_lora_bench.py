"""``pagedllm bench lora`` on the default model with a tiny workload: both systems finish every
request, the report's figures agree with each other, and an adapter held in memory weighs what its
file does (no speed is asserted: that is the benchmark's own job)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm.entrypoints.cli import main

pytestmark = pytest.mark.slow


def test_bench_lora_reports_consistent_figures(tmp_path: Path) -> None:
    out = tmp_path / "lora.json"
    args = ["bench", "lora", "--num-prompts", "4", "--input-len", "16", "--output-len", "8", "--pairs", "1"]
    args += ["--num-adapters", "2", "--lora-rank", "4", "--num-kv-blocks", "64", "--output-json", str(out)]
    assert main(args) == 0
    data = json.loads(out.read_text())
    (pair,) = data["pairs"]
    base, lora = pair["base"], pair["lora"]
    assert base["output_tok_s"] == pytest.approx(4 * 8 / base["seconds"])
    assert lora["output_tok_s"] == pytest.approx(4 * 8 / lora["seconds"])
    assert data["share"] == pytest.approx(lora["output_tok_s"] / base["output_tok_s"])
    loading = data["loading"]
    assert loading["load_seconds"] > 0 and loading["slot_bytes"] > 0
    # float32 weights held as in the file (its header aside)
    assert 0.97 < loading["adapter_bytes"] / loading["file_bytes"] <= 1.0


def test_bench_lora_refuses_bad_counts() -> None:
    assert main(["bench", "lora", "--num-adapters", "0"]) == 2
