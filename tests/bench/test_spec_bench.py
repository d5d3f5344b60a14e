"""``pagedllm bench spec`` on the default model with short outputs: both engines run the 16
input-grounded chat requests, produce the same greedy tokens, and the report carries the acceptance
figures, consistent with each other (no speed is asserted: that is the benchmark's own job)."""

from __future__ import annotations

import json
from pathlib import Path

from pagedllm.entrypoints.cli import main
from pagedllm_bench.spec import grounded_requests


def test_bench_spec_reports_acceptance_and_equal_tokens(tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    args = ["bench", "spec", "--output-len", "24", "--concurrency", "16", "--output-json", str(out)]
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert len(grounded_requests()) == 16 and data["same_tokens"] == 16
    stats = data["spec_stats"]
    assert 0 < stats["accepted_tokens"] <= stats["draft_tokens"]
    assert data["acceptance_rate"] == stats["accepted_tokens"] / stats["draft_tokens"]
    assert data["mean_accepted_length"] == 1 + stats["accepted_tokens"] / stats["drafts"]
    for system in data["systems"].values():
        assert system["batch1_decode_tok_s"] > 0 and system["concurrent_output_tok_s"] > 0
    ratios = data["ratios"]
    speculative, plain = data["systems"]["speculative"], data["systems"]["plain"]
    assert ratios["batch1_decode"] == speculative["batch1_decode_tok_s"] / plain["batch1_decode_tok_s"]


def test_bench_spec_refuses_a_bad_config() -> None:
    assert main(["bench", "spec", "--spec", '{"method": "ngram", "num_speculative_tokens": 0}']) == 2
