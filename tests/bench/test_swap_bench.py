"""``pagedllm bench swap`` on the default model with a small oversubscribed pool: recompute never
swaps, auto does, both finish every request, and the report's figures agree with each other (no speed
is asserted: that is the benchmark's own job)."""

from __future__ import annotations

import json
from pathlib import Path

from pagedllm.entrypoints.cli import main


def test_bench_swap_compares_auto_with_recompute(tmp_path: Path) -> None:
    out = tmp_path / "swap.json"
    args = ["bench", "swap", "--num-prompts", "4", "--input-len", "48:64", "--output-len", "24"]
    args += ["--num-kv-blocks", "10", "--swap-space", "0.05", "--output-json", str(out)]
    assert main(args) == 0
    data = json.loads(out.read_text())
    recompute, auto = data["systems"]["recompute"], data["systems"]["auto"]
    assert recompute["preemptions"] > 0 and recompute["swapped_out"] == 0
    assert auto["swapped_out"] > 0 and auto["swapped_in"] == auto["swapped_out"]
    # Out: swaps and evicted prefix blocks the host tier keeps; in: swaps back and host prefix hits.
    assert auto["swap_out_bytes"] >= auto["swap_in_bytes"] > 0
    assert data["speedup"] == recompute["seconds"] / auto["seconds"]
    assert 0 <= data["same_tokens"] <= 4


def test_bench_swap_needs_a_host_tier() -> None:
    assert main(["bench", "swap", "--swap-space", "0"]) == 2
