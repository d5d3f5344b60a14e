"""``pagedllm bench embed`` on a tiny workload through the CLI entry point, and its sentence generator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm.entrypoints.cli import main
from pagedllm_bench.embed import mixed_sentences


def test_bench_embed_reports_both_systems(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "embed.json"
    argv = ["bench", "embed", "--num-sentences", "40", "--max-words", "60", "--output-json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["model"] == "sentence-transformers/all-MiniLM-L6-v2"  # the model as it was named
    workload = data["workload"]
    assert workload["num_sentences"] == 40 and workload["num_tokens"] > 40 * 3
    assert data["baseline_batch_size"] == 32 and data["num_threads"] >= 1
    assert set(data["systems"]) == {"pagedllm", "transformers"}
    for figures in data["systems"].values():
        assert set(figures) == {"sentences_per_s", "tokens_per_s", "elapsed_s", "cpu_cores_used"}
        assert figures["sentences_per_s"] == pytest.approx(40 / figures["elapsed_s"])
    ours, theirs = data["systems"]["pagedllm"], data["systems"]["transformers"]
    assert data["ratio"] == pytest.approx(ours["sentences_per_s"] / theirs["sentences_per_s"])
    assert data["min_cosine"] >= 0.9999  # the same model: the same embeddings
    assert {"processor", "torch_num_threads"} <= set(data["machine"])
    printed = capsys.readouterr().out
    assert "pagedllm / transformers" in printed and "40 sentences" in printed


def test_bench_embed_refuses_bad_arguments() -> None:
    assert main(["bench", "embed", "--num-sentences", "0"]) == 2
    assert main(["bench", "embed", "--min-words", "9", "--max-words", "3"]) == 2


def test_mixed_sentences_are_deterministic_and_mixed() -> None:
    a = mixed_sentences(200, 5, 200, seed=3)
    assert a == mixed_sentences(200, 5, 200, seed=3) != mixed_sentences(200, 5, 200, seed=4)
    lengths = [len(s.split()) for s in a]
    assert min(lengths) >= 5 and max(lengths) <= 200
    assert max(lengths) - min(lengths) > 150  # mixed lengths, not one size
