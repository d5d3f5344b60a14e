"""``pagedllm bench parallel`` on a tiny model through the CLI entry point, and its memory check."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import psutil
import pytest

from helpers.model_factory import make_tiny_hf_model
from helpers.processes import own_descendants
from pagedllm.config import EngineConfig
from pagedllm.entrypoints.cli import main
from pagedllm_bench import parallel as parallel_bench

TINY = [
    "--num-prompts", "4", "--input-len", "4:16", "--output-len", "2:5",
    "--num-kv-blocks", "64", "--max-model-len", "256",
]  # fmt: skip


def rank_processes() -> list[psutil.Process]:
    """Rank processes started by this test process (alive ones)."""
    out = []
    for child in own_descendants():
        try:
            if (
                "pagedllm.worker.parallel_executor" in " ".join(child.cmdline())
                and child.status() != "zombie"
            ):
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


def assert_no_ranks_left(timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while rank_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not rank_processes(), "rank processes left behind"


@pytest.fixture(scope="module")
def tied_one_kv_head(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Tied embeddings and one KV head: tensor parallel 2 replicates it, pipeline parallel 2 holds the
    embedding on both stages; both are replicated parts of the memory bound."""
    return make_tiny_hf_model(
        tmp_path_factory.mktemp("parallel"), "llama", tie_word_embeddings=True, num_key_value_heads=1
    )


def test_bench_parallel_reports_both_systems_and_every_rank(
    tied_one_kv_head: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "parallel.json"
    assert main(["bench", "parallel", "--model", tied_one_kv_head, *TINY, "--output-json", str(out)]) == 0
    assert_no_ranks_left()
    data = json.loads(out.read_text())
    assert data["benchmark"] == "parallel"
    # Neither size given: two ranks, tensor parallel since the tiny model's 4 heads split in two.
    assert data["parallel"]["tensor_parallel_size"] == 2 and data["parallel"]["pipeline_parallel_size"] == 1
    assert data["parallel"]["chosen"].startswith("default")
    single, parallel = data["systems"]["single"], data["systems"]["parallel"]
    n_out = data["workload"]["num_output_tokens"]
    assert single["output_tokens"] == parallel["output_tokens"] == n_out  # EOS ignored
    assert len(single["runs"]) == 2  # the single rank ran before and after the parallel ranks
    assert parallel["ranks"] == 2 and parallel["threads_per_rank"] >= 1
    assert data["ratios"]["output_tokens_per_s"] == pytest.approx(
        parallel["output_tokens_per_s"] / single["output_tokens_per_s"]
    )
    assert data["same_greedy_tokens"] == {"requests": 4, "of": 4}
    memory = data["memory"]
    assert [r["rank"] for r in memory["ranks"]] == [0, 1]
    for r in memory["ranks"]:
        assert r["ok"] and 0 < r["bytes"] <= r["bound"]
        assert r["replicated_bytes"]["norms"] > 0 and r["replicated_bytes"]["replicated_kv_heads"] > 0
        assert r["bytes"] < 0.6 * memory["full_bytes"]
    assert memory["all_ok"] and data["goals"]["memory_met"] is True
    assert memory["driver_resident"]["ok"]
    assert "parallel / single output tok/s" in capsys.readouterr().out


def _args(**sizes: int | None) -> argparse.Namespace:
    return argparse.Namespace(tensor_parallel_size=sizes.get("tp"), pipeline_parallel_size=sizes.get("pp"))


def test_sizes_default_to_two_ranks_the_model_takes(tied_one_kv_head: str) -> None:
    tiny = EngineConfig(model=tied_one_kv_head)
    assert parallel_bench.parallel_sizes(_args(), tiny)[:2] == (2, 1)
    assert parallel_bench.parallel_sizes(_args(pp=2), tiny) == (1, 2, "given")
    # The default model's 9 attention heads do not split in two: pipeline parallel 2.
    tp, pp, chosen = parallel_bench.parallel_sizes(_args(), EngineConfig(model=None))
    assert (tp, pp) == (1, 2) and "9 attention heads" in chosen
    with pytest.raises(ValueError, match="at least 2"):
        parallel_bench.parallel_sizes(_args(tp=1), tiny)
    with pytest.raises(ValueError, match="tensor_parallel_size 3"):
        parallel_bench.parallel_sizes(_args(tp=3), tiny)


def test_refused_sizes_exit_before_any_engine(tied_one_kv_head: str) -> None:
    args = ["bench", "parallel", "--model", tied_one_kv_head, *TINY]
    assert main([*args, "--tensor-parallel-size", "3"]) == 2
    assert main([*args, "--pipeline-parallel-size", "3"]) == 2  # 2 layers
    assert_no_ranks_left()


def test_memory_only_starts_nothing(tied_one_kv_head: str, tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    args = ["bench", "parallel", "--model", tied_one_kv_head, "--pipeline-parallel-size", "2"]
    assert main([*args, "--memory-only", "--output-json", str(out)]) == 0
    assert not rank_processes()
    data = json.loads(out.read_text())
    assert "systems" not in data and data["parallel"]["world_size"] == 2 and data["goals"]["memory_met"]
    assert [r["layers"] for r in data["memory"]["ranks"]] == [[0, 1], [1, 2]]


def test_memory_check_of_a_pipeline_and_of_a_rank_holding_everything(
    tied_one_kv_head: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = EngineConfig(model=tied_one_kv_head, tensor_parallel_size=2, pipeline_parallel_size=2)
    memory = parallel_bench.memory_check(config)
    assert memory["all_ok"] and len(memory["ranks"]) == 4
    for r in memory["ranks"]:
        assert r["layers"] == ([0, 1] if r["pp_rank"] == 0 else [1, 2])
    # The first stage holds the vocabulary (the tied embedding, which is also the LM head) beyond an
    # even share; the last holds none of it.
    first = [r for r in memory["ranks"] if r["pp_rank"] == 0]
    last = [r for r in memory["ranks"] if r["pp_rank"] == 1]
    assert all(r["replicated_bytes"]["uneven_stage"] > 0 for r in first)
    assert min(r["bytes"] for r in first) > max(r["bytes"] for r in last)
    # A rank that loaded the whole checkpoint is caught.
    monkeypatch.setattr(parallel_bench, "weight_selection", lambda cfg, placement, name: ())
    whole = parallel_bench.memory_check(dataclasses.replace(config, pipeline_parallel_size=1))
    assert not whole["all_ok"] and not any(r["ok"] for r in whole["ranks"])
