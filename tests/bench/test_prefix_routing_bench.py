"""``pagedllm bench prefix-routing``: its workload, and the benchmark run in-process on a tiny workload."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psutil
import pytest

from helpers.processes import own_descendants
from pagedllm_bench.common import write_json
from pagedllm_bench.prefix_routing import (
    ONE_CORE,
    ONE_CORE_DOUBLE_KV,
    PREFIX,
    ROUND_ROBIN,
    OutputComparison,
    RunResult,
    RunSpec,
    compare_outputs,
    default_runs,
    grouped_workload,
    report,
    run_prefix_routing,
)

CORE_MODULE = "pagedllm.engine.proc.core_process"


def _core_processes() -> list[psutil.Process]:
    found = []
    for proc in own_descendants():
        try:
            if any(CORE_MODULE in part for part in proc.cmdline()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def test_grouped_workload_is_seeded_interleaved_and_grouped() -> None:
    w = grouped_workload(8, 16, 64, 8, 4, vocab_size=1000, seed=0, exclude_token_ids=range(10))
    assert w == grouped_workload(8, 16, 64, 8, 4, vocab_size=1000, seed=0, exclude_token_ids=range(10))
    assert w.requests != grouped_workload(8, 16, 64, 8, 4, vocab_size=1000, seed=1).requests
    assert len(w.requests) == 128 and sorted(w.groups) == sorted(list(range(8)) * 16)
    # Not a cyclic order: under round-robin on two cores the groups would split by parity.
    assert w.groups != [i % 8 for i in range(128)]
    assert {g % 2 for g in w.groups[0::2]} == {0, 1}
    systems: dict[int, list[int]] = {}
    for g, r in zip(w.groups, w.requests, strict=True):
        assert r.prompt_len == 72 and r.output_len == 4
        assert min(r.prompt_token_ids) >= 10  # excluded ids never appear
        assert systems.setdefault(g, r.prompt_token_ids[:64]) == r.prompt_token_ids[:64]
    assert len({tuple(s) for s in systems.values()}) == 8  # each group its own system prompt
    with pytest.raises(ValueError, match="--per-group"):
        grouped_workload(2, 0, 64, 8, 4, vocab_size=1000)


@pytest.mark.slow
def test_prefix_routing_bench_on_a_tiny_workload(tmp_path: Path) -> None:
    workload = grouped_workload(2, 3, 64, 8, 2, vocab_size=49152, seed=0, exclude_token_ids=range(17))
    engine_args = {"max_model_len": 256, "max_num_seqs": 16}
    checked: list[str] = []

    def before_shutdown(spec: RunSpec, llm: Any) -> None:
        llm.llm_engine.check_idle()
        # The previous run's cores are gone: only this run's are alive.
        assert len(_core_processes()) == spec.data_parallel_size
        checked.append(spec.name)

    result = run_prefix_routing(workload, engine_args, default_runs(64), before_shutdown=before_shutdown)
    assert checked == [ONE_CORE, PREFIX, ROUND_ROBIN, ONE_CORE_DOUBLE_KV]
    assert _core_processes() == []

    out = tmp_path / "prefix_routing.json"
    write_json(str(out), result.to_json())
    data = json.loads(out.read_text())
    assert data["outputs_identical"] is True and data["outputs_close"] is True
    comparisons = data["output_comparisons"]
    assert comparisons.pop("reference") == ONE_CORE
    assert set(comparisons) == {PREFIX, ROUND_ROBIN, ONE_CORE_DOUBLE_KV}
    for c in comparisons.values():
        assert c == {"identical": 6, "near_tie": 0, "mismatch": 0, "differing": [], "max_near_tie_gap": None}
    assert data["workload"]["num_requests"] == 6 and data["workload"]["system_len"] == 64
    assert [r["name"] for r in data["runs"]] == checked
    for r in data["runs"]:
        assert 0.0 <= r["prefix_cache_hit_rate"] <= 1.0
        assert r["output_tokens"] == 12 and r["output_tokens_per_s"] > 0
        assert r["prefix_cache_queries"] == workload.num_prompt_tokens
        assert len(r["cores"]) == r["data_parallel_size"]
        assert sum(c["requests"] for c in r["cores"].values()) == 6
        assert sum(c["prefix_cache_hits"] for c in r["cores"].values()) == r["prefix_cache_hits"]
    assert (
        data["runs"][2]["num_kv_blocks_per_core"] == 64 and data["runs"][3]["num_kv_blocks_per_core"] == 128
    )
    assert all(len(t) == 2 for run in result.runs for t in run.token_ids)
    assert all(len(top) == 2 for run in result.runs for top in run.top_logprobs)
    # Every request of a group after its first finds the 64-token system prompt on its core.
    rates = {r.spec.name: r.hit_rate for r in result.runs}
    assert rates[PREFIX] == pytest.approx(4 * 64 / workload.num_prompt_tokens)
    assert rates[PREFIX] >= rates[ROUND_ROBIN]
    for key in ("prefix_vs_one_core", "prefix_vs_round_robin"):
        assert set(data["goals"][key]) == {"ratio", "goal", "met"}
    printed = report(result)
    assert "hit rate prefix / round-robin" in printed and "identical across runs: true" in printed


def test_compare_outputs_tells_near_ties_from_mismatches() -> None:
    spec = RunSpec(ONE_CORE, 1, "prefix", 64)

    def run(token_ids: list[list[int]], top: list[list[dict[int, float]]]) -> RunResult:
        return RunResult(spec, "m", 1.0, 2, 10, 5, 5, 0, {}, token_ids, top)

    reference = run(
        [[1, 2], [3, 4], [5, 6]],
        [[{1: -0.1}, {2: -0.5, 9: -0.7}], [{3: -0.2}, {4: -0.3}], [{5: -0.1}, {6: -0.2}]],
    )
    other = run(
        [[1, 2], [3, 7], [5, 8]],
        [[{1: -0.1}, {2: -0.5, 9: -0.7}], [{3: -0.2}, {7: -0.3}], [{5: -0.1}, {8: -0.2}]],
    )
    assert compare_outputs(reference, reference) == OutputComparison(identical=3)
    assert compare_outputs(reference, other) == OutputComparison(identical=1, mismatch=2, differing=[1, 2])
    flipped = run(
        [[1, 9], [3, 4], [5, 6]],
        [[{1: -0.1}, {9: -0.6, 2: -0.6}], [{3: -0.2}, {4: -0.3}], [{5: -0.1}, {6: -0.2}]],
    )
    c = compare_outputs(reference, flipped)
    assert (c.identical, c.near_tie, c.mismatch, c.differing) == (2, 1, 0, [0])
    assert c.max_near_tie_gap == pytest.approx(0.2)
