"""Parallel configurations that cannot run are refused with a ValueError naming the setting, before
any rank process starts: sizes that do not split the model, architectures and tasks the parallel
ranks do not cover, and inconsistent multi-machine settings (in ``LLM``, in ``run_worker_node`` and
on the ``pagedllm serve --node-rank N`` command line)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import pagedllm.worker.parallel_executor as parallel_executor
from helpers.server import REPO_ROOT, free_port
from pagedllm import LLM
from pagedllm.config import EngineConfig

SMALL: dict[str, Any] = {"dtype": "float32", "num_kv_blocks": 16, "max_model_len": 128}


@pytest.fixture
def no_rank_starts(monkeypatch: pytest.MonkeyPatch, procs: Any) -> Iterator[list[int]]:
    """Starting a rank process fails the test (and is recorded); no process may appear either."""
    started: list[int] = []

    def refuse(config: EngineConfig, rank: int, master_port: int) -> Any:
        started.append(rank)
        raise AssertionError(f"rank {rank} was started before the configuration was refused")

    monkeypatch.setattr(parallel_executor, "start_rank_process", refuse)
    yield started
    assert started == []
    assert procs.new() == [], procs.describe(procs.new())


# (case id, tiny model or None for the default model, engine arguments, words the message holds)
REFUSED: list[tuple[str, str | None, dict[str, Any], tuple[str, ...]]] = [
    (
        "tp-not-dividing-heads",
        None,
        {"tensor_parallel_size": 2},
        ("tensor_parallel_size 2", "9 attention heads"),
    ),
    ("pp-above-layers", "llama", {"pipeline_parallel_size": 3}, ("pipeline_parallel_size 3", "2 layers")),
    (
        "tp-and-pp-above-layers",
        "llama",
        {"tensor_parallel_size": 2, "pipeline_parallel_size": 4},
        ("pipeline_parallel_size 4",),
    ),
    ("kv-heads", "llama6_kv2", {"tensor_parallel_size": 3}, ("tensor_parallel_size 3", "2 KV heads")),
    ("mlp-width", "llama_mlp129", {"tensor_parallel_size": 2}, ("tensor_parallel_size 2", "MLP width 129")),
    ("gemma2", "gemma2", {"tensor_parallel_size": 2}, ("tensor_parallel_size", "gemma2")),
    ("mixtral", "mixtral", {"tensor_parallel_size": 2}, ("tensor_parallel_size", "mixture-of-experts")),
    (
        "mixtral-pp",
        "mixtral",
        {"pipeline_parallel_size": 2},
        ("pipeline_parallel_size", "mixture-of-experts"),
    ),
    (
        "partition-count",
        "llama",
        {"pipeline_parallel_size": 2, "pipeline_layer_partition": "1,1,1"},
        ("pipeline_layer_partition '1,1,1'", "2 positive layer counts", "2 layers"),
    ),
    (
        "partition-sum",
        "llama",
        {"pipeline_parallel_size": 2, "pipeline_layer_partition": "1,2"},
        ("pipeline_layer_partition '1,2'", "2 layers"),
    ),
    (
        "partition-empty-stage",
        "llama",
        {"pipeline_parallel_size": 2, "pipeline_layer_partition": "0,2"},
        ("pipeline_layer_partition '0,2'", "positive"),
    ),
    (
        "partition-not-numbers",
        "llama",
        {"pipeline_parallel_size": 2, "pipeline_layer_partition": "half,half"},
        ("pipeline_layer_partition 'half,half'",),
    ),
    (
        "partition-without-pipeline",
        "llama",
        {"tensor_parallel_size": 2, "pipeline_layer_partition": "1,1"},
        ("pipeline_layer_partition", "pipeline_parallel_size > 1"),
    ),
    (
        "partition-one-rank",
        "llama",
        {"pipeline_layer_partition": "2"},
        ("pipeline_layer_partition", "pipeline_parallel_size > 1"),
    ),
    ("task-embed", "llama", {"tensor_parallel_size": 2, "task": "embed"}, ("tensor_parallel_size", "embed")),
    ("tp-zero", "llama", {"tensor_parallel_size": 0}, ("tensor_parallel_size",)),
    ("pp-zero", "llama", {"pipeline_parallel_size": 0}, ("pipeline_parallel_size",)),
    ("nnodes-zero", "llama", {"nnodes": 0}, ("nnodes",)),
    ("nnodes-without-master-port", "llama", {"tensor_parallel_size": 2, "nnodes": 2}, ("master_port",)),
    (
        "node-rank-out-of-range",
        "llama",
        {"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 2, "master_port": 29999},
        ("node_rank",),
    ),
    ("node-rank-negative", "llama", {"node_rank": -1}, ("node_rank",)),
    (
        "node-rank-not-0-in-engine",
        "llama",
        {"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 1, "master_port": 29999},
        ("node_rank 1",),
    ),
    (
        "nnodes-not-dividing-ranks",
        "llama",
        {"tensor_parallel_size": 2, "nnodes": 3, "master_port": 29999},
        ("nnodes 3",),
    ),
    (
        "bogus-backend",
        "llama",
        {"tensor_parallel_size": 2, "distributed_executor_backend": "bogus"},
        ("distributed_executor_backend", "bogus"),
    ),
    (
        "ray-with-nnodes",
        "llama",
        {"tensor_parallel_size": 2, "nnodes": 2, "master_port": 29999, "distributed_executor_backend": "ray"},
        ("distributed_executor_backend",),
    ),
    (
        "timeout-zero",
        "llama",
        {"tensor_parallel_size": 2, "distributed_timeout_s": 0},
        ("distributed_timeout_s",),
    ),
]


@pytest.mark.parametrize("model,args,words", [pytest.param(m, a, w, id=i) for i, m, a, w in REFUSED])
def test_refused_before_any_rank_starts(
    model: str | None,
    args: dict[str, Any],
    words: tuple[str, ...],
    tiny_model: Callable[[str], str],
    no_rank_starts: list[int],
) -> None:
    path = tiny_model(model) if model is not None else None
    with pytest.raises(ValueError) as info:
        LLM(path, **SMALL, **args)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_encoder_model_refused(no_rank_starts: list[int]) -> None:
    """An encoder (all-MiniLM-L6-v2, BERT) runs on one rank."""
    with pytest.raises(ValueError, match="tensor_parallel_size") as info:
        LLM("sentence-transformers/all-MiniLM-L6-v2", tensor_parallel_size=2, **SMALL)
    assert "encoder" in str(info.value)


def test_worker_node_refuses_before_starting_ranks(
    tiny_model: Callable[[str], str], no_rank_starts: list[int]
) -> None:
    """``run_worker_node`` (``pagedllm serve --node-rank N``) checks the split before starting this
    machine's ranks: here 2 x 3 ranks, 3 per machine, would have started two processes."""
    config = EngineConfig(
        model=tiny_model("llama"),
        tensor_parallel_size=2,
        pipeline_parallel_size=3,
        nnodes=2,
        node_rank=1,
        master_port=free_port(),
        **SMALL,
    )
    with pytest.raises(ValueError, match="pipeline_parallel_size 3"):
        parallel_executor.run_worker_node(config)
    config = EngineConfig(
        model=tiny_model("llama"),
        tensor_parallel_size=2,
        nnodes=4,
        node_rank=1,
        master_port=free_port(),
        **SMALL,
    )
    with pytest.raises(ValueError, match="nnodes 4"):
        parallel_executor.run_worker_node(config)


@pytest.mark.parametrize(
    "flags,words",
    [
        pytest.param(["--pipeline-parallel-size", "3"], ("pipeline_parallel_size 3",), id="pp-above-layers"),
        pytest.param(["--node-rank", "2"], ("node_rank",), id="node-rank-out-of-range"),
    ],
)
def test_worker_node_command_line_refuses(
    flags: list[str], words: tuple[str, ...], tiny_model: Callable[[str], str], procs: Any
) -> None:
    """``pagedllm serve --node-rank 1`` with a configuration that cannot run exits with status 2 and
    says why, without starting a rank (it would otherwise wait for the driver)."""
    argv = [
        "--tensor-parallel-size",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-port",
        str(free_port()),
    ]
    argv += ["--dtype", "float32", "--num-kv-blocks", "16", "--max-model-len", "128"]
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", tiny_model("llama"), *argv, *flags]
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    for word in words:
        assert word in result.stderr, result.stderr[-2000:]
