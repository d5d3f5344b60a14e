"""Decode CUDA graphs: bucket selection and input padding (pure functions), the static-buffer decode
path on CPU (no capture there, the same forward replays eagerly), a real capture on CUDA, and the GPU
benchmark script end to end in its tiny CPU configuration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from helpers.reference import assert_greedy_close
from pagedllm import LLM, SamplingParams
from pagedllm.model.config import ModelConfig
from pagedllm.sched.kv_cache_manager import BlockTableChange
from pagedllm.worker.block_tables import BlockTableRows
from pagedllm.worker.cuda_graphs import (
    CUDAGraphRunner,
    capture_batch_sizes,
    graph_memory_estimate,
    select_batch_size,
)
from pagedllm.worker.step_inputs import DecodeInputs, fill_decode_inputs

REPO_ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------------
# Buckets
# --------------------------------------------------------------------------------------------------


def test_capture_batch_sizes() -> None:
    assert capture_batch_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(5) == [1, 2, 4, 5]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    with pytest.raises(ValueError):
        capture_batch_sizes(0)


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 20, 100, 256])
def test_select_batch_size_is_the_smallest_bucket_that_fits(max_num_seqs: int) -> None:
    sizes = capture_batch_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_num_seqs
    for n in range(1, max_num_seqs + 1):
        bucket = select_batch_size(sizes, n)
        assert bucket is not None and bucket >= n
        assert all(s < n for s in sizes if s < bucket)
    assert select_batch_size(sizes, max_num_seqs + 1) is None
    with pytest.raises(ValueError):
        select_batch_size(sizes, 0)


# --------------------------------------------------------------------------------------------------
# Input padding
# --------------------------------------------------------------------------------------------------


def test_fill_decode_inputs_pads_rows_to_the_bucket() -> None:
    bs = 4
    out = DecodeInputs.zeros(max_rows=8, max_blocks_per_seq=6)
    # Stale values from an earlier, wider batch must not leak into padding rows.
    out.input_ids[:] = 99
    out.positions[:] = 99
    out.slot_mapping[:] = 99
    out.seq_lens[:] = 99
    out.block_tables[:] = 77
    token_ids = [11, 12, 13]
    positions = [0, 5, 9]  # contexts of 1, 6 and 10 tokens
    # Rows may hold more blocks than the context covers (-1 here: never read).
    tables = np.array([[7, 50, -1, -1], [3, 8, 60, -1], [2, 4, 9, 70]], dtype=np.int32)
    width = fill_decode_inputs(token_ids, positions, tables, bs, 4, out)

    assert width == 3  # position 9 is in logical block 2
    assert out.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert out.positions[:4].tolist() == [0, 5, 9, 0]
    assert out.seq_lens[:4].tolist() == [1, 6, 10, 1]
    # slot = block_table[pos // bs] * bs + pos % bs; padding writes nowhere.
    assert out.slot_mapping[:4].tolist() == [7 * bs + 0, 8 * bs + 1, 9 * bs + 1, -1]
    table = out.block_tables[: 4 * width].reshape(4, width)
    assert table[0, :1].tolist() == [7]
    assert table[1, :2].tolist() == [3, 8]
    assert table[2, :3].tolist() == [2, 4, 9]
    assert table[3, 0] == 0  # padding attends to block 0, always a valid block
    # Rows beyond the bucket are untouched.
    assert out.input_ids[4] == 99 and out.slot_mapping[4] == 99


def test_fill_decode_inputs_full_bucket_and_errors() -> None:
    out = DecodeInputs.zeros(max_rows=2, max_blocks_per_seq=2)
    width = fill_decode_inputs([5, 6], [16, 31], np.array([[1, 2], [3, 4]], dtype=np.int32), 16, 2, out)
    assert width == 2
    assert out.slot_mapping.tolist() == [2 * 16, 4 * 16 + 15]
    assert out.block_tables.reshape(2, 2).tolist() == [[1, 2], [3, 4]]
    with pytest.raises(ValueError):  # more rows than the bucket
        fill_decode_inputs([1, 2, 3], [0, 0, 0], np.zeros((3, 1), dtype=np.int32), 16, 2, out)
    with pytest.raises(ValueError):  # table wider than the staging buffer
        fill_decode_inputs([1], [40], np.array([[0, 1, 2]], dtype=np.int32), 16, 2, out)
    with pytest.raises(ValueError):  # a table that does not cover the context
        fill_decode_inputs([1], [20], np.array([[0]], dtype=np.int32), 16, 2, out)


def test_block_table_rows_follow_appends_drops_and_batch_changes() -> None:
    """Rows are kept from the scheduler's changes alone: appends copy the new ids only, a change at
    entry 0 rewrites a table, dropped tables give their rows back, and rows are held across steps."""
    rows = BlockTableRows(max_rows=3, max_blocks_per_seq=4)
    want: dict[str, list[int]] = {}

    def check(dropped: list[str], changes: list[BlockTableChange], batch: list[str]) -> np.ndarray:
        rows.apply(dropped, changes)
        for rid in dropped:
            want.pop(rid, None)
        for c in changes:
            want[c.request_id] = want.get(c.request_id, [])[: c.start] + c.block_ids
        indices = rows.rows(batch)
        assert len(set(indices.tolist())) == len(batch) and len(rows) == len(want)
        for rid, i in zip(batch, indices, strict=True):
            assert rows.num_blocks(rid) == len(want[rid])
            assert rows.array[i, : len(want[rid])].tolist() == want[rid], rid
        return indices

    row_a = check([], [BlockTableChange("a", 0, [5]), BlockTableChange("b", 0, [7, 8])], ["a", "b"])[0]
    rows.array[row_a, 0] = -5  # (so a full rewrite would be noticed)
    rows.apply([], [BlockTableChange("a", 1, [9])])  # a decode step filled a block: one id copied
    assert rows.rows(["a", "b"])[0] == row_a and rows.array[row_a, :2].tolist() == [-5, 9]
    rows.array[row_a, 0] = 5
    want["a"] = [5, 9]
    check([], [], ["a", "b"])
    check(["a"], [BlockTableChange("a", 0, [1, 2])], ["a", "b"])  # preempted and readmitted
    check([], [BlockTableChange("c", 0, [])], ["c", "b", "a"])  # order changes keep rows; empty table
    check([], [], ["c"])  # a and b sit the step out: their rows are kept
    assert rows.rows(["a", "b"]).tolist() == check([], [], ["a", "b"]).tolist()
    check(
        ["a", "b"], [BlockTableChange("d", 0, [3]), BlockTableChange("e", 0, [4, 4, 4, 4])], ["d", "e", "c"]
    )
    with pytest.raises(ValueError, match="hold block tables"):  # more tables than rows
        rows.apply([], [BlockTableChange("f", 0, [1])])
    with pytest.raises(ValueError, match="at entry 3"):  # a change that leaves a gap
        rows.apply([], [BlockTableChange("d", 3, [1])])
    with pytest.raises(ValueError, match="exceed"):  # a table longer than a row
        rows.apply([], [BlockTableChange("d", 1, [1, 2, 3, 4])])
    with pytest.raises(KeyError, match="no block table"):
        rows.rows(["a"])


def test_graph_memory_estimate_grows_with_the_batch() -> None:
    cfg = ModelConfig(
        architecture="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    )
    small = graph_memory_estimate(cfg, 8, torch.bfloat16)
    large = graph_memory_estimate(cfg, 256, torch.bfloat16)
    assert 128 << 20 < small < large
    # The shared float32 logits output of the largest bucket dominates.
    assert large > 256 * 151936 * 4


# --------------------------------------------------------------------------------------------------
# The static-buffer decode path on CPU
# --------------------------------------------------------------------------------------------------


def _outputs(llm: Any, prompts: list[list[int]], params: list[SamplingParams]) -> list[Any]:
    return [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.slow
def test_static_decode_path_matches_eager_on_cpu(tmp_path: Path) -> None:
    """Bucketed, padded decode steps over the static buffers give the eager engine's tokens."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    from helpers.model_factory import make_tiny_hf_model

    path = make_tiny_hf_model(tmp_path, "qwen3", tie_word_embeddings=True, initializer_range=0.2)
    llm = LLM(
        path,
        attention_backend="triton",
        device="cpu",
        dtype="float32",
        max_num_seqs=4,
        num_kv_blocks=64,
        max_model_len=256,
        enable_prefix_caching=False,
    )
    prompts = [list(range(5, 22)), [100, 200, 300], [7] * 40]
    params = [SamplingParams(temperature=0, max_tokens=m, logprobs=3, ignore_eos=True) for m in (6, 3, 5)]
    eager = _outputs(llm, prompts, params)

    runner = llm.llm_engine.runner
    assert runner.kv_cache is not None
    graphs = CUDAGraphRunner(
        runner.model,
        runner.kv_cache.layers,
        max_num_seqs=4,
        max_model_len=256,
        block_size=llm.llm_engine.config.block_size,
        device=torch.device("cpu"),
    )
    graphs.capture()
    buckets: list[int] = []
    replay = graphs.replay

    def counting_replay(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        buckets.append(batch_size)
        return replay(batch_size)

    graphs.replay = counting_replay  # type: ignore[method-assign]
    runner.cuda_graphs = graphs
    engine = llm.llm_engine
    try:
        replayed = _outputs(llm, prompts, params)
        # Scheduled ahead: each decode step's tokens come from the previous step's samples on the
        # device, written into the graph's static input buffer.
        engine.async_scheduling = True
        load_inputs = graphs.load_inputs
        pending_loads: list[int] = []

        def counting_load(scheduler_output: Any) -> int:
            pending_loads.append(
                sum(scheduled.request.num_pending_tokens for scheduled in scheduler_output.scheduled_requests)
            )
            return load_inputs(scheduler_output)

        graphs.load_inputs = counting_load  # type: ignore[method-assign]
        ahead = _outputs(llm, prompts, params)
    finally:
        runner.cuda_graphs = None
        engine.async_scheduling = False
    # Three requests decode in the bucket of 4 (one padding row), then 2, then 1 as they finish.
    assert buckets and set(buckets) <= {1, 2, 4} and 4 in buckets and 1 in buckets
    assert pending_loads and all(n > 0 for n in pending_loads), pending_loads
    for a, b, c in zip(eager, replayed, ahead, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        for step_a, step_b, step_c in zip(a.logprobs, b.logprobs, c.logprobs, strict=True):
            assert step_a.keys() == step_b.keys() == step_c.keys()
            for tok in step_a:
                assert abs(step_a[tok].logprob - step_b[tok].logprob) < 1e-4
                assert abs(step_a[tok].logprob - step_c[tok].logprob) < 1e-4
    engine.check_idle()


# --------------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_match_eager_on_gpu(tmp_path: Path) -> None:
    from helpers.model_factory import make_tiny_hf_model

    path = make_tiny_hf_model(tmp_path, "qwen3", tie_word_embeddings=True, initializer_range=0.2)
    common: dict[str, Any] = {
        "device": "cuda",
        "dtype": "float32",
        "max_num_seqs": 20,
        "max_model_len": 512,
        "kv_cache_memory_bytes": 64 << 20,
    }
    graphed = LLM(path, **common)
    eager = LLM(path, enforce_eager=True, **common)
    graphs = graphed.llm_engine.runner.cuda_graphs
    assert graphs is not None and graphs.batch_sizes == [1, 2, 4, 8, 16, 20]
    assert graphs.capture_time_s is not None
    assert eager.llm_engine.runner.cuda_graphs is None
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 49152, int(n)).tolist() for n in rng.integers(1, 200, 19)]
    params = [
        SamplingParams(temperature=0, max_tokens=int(m), logprobs=5, ignore_eos=True)
        for m in rng.integers(1, 40, 19)
    ]
    a = _outputs(graphed, prompts, params)
    b = _outputs(eager, prompts, params)
    # Graphs use a fixed split of the context, so near-ties may flip.
    for x, y in zip(a, b, strict=True):
        assert_greedy_close(x.token_ids, x.logprobs, y.token_ids, y.logprobs, "graphs vs eager")


# --------------------------------------------------------------------------------------------------
# The GPU benchmark script, tiny and on CPU
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_run_gpu_script_tiny_on_cpu(tmp_path: Path) -> None:
    out_json = tmp_path / "results.json"
    env = {**os.environ, "OUT": str(tmp_path / "out"), "TRITON_INTERPRET": "1"}
    os.makedirs(env["OUT"])
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "benchmarks" / "gpu" / "run_gpu.py"),
            "--tiny",
            "--device",
            "cpu",
            "--output-json",
            str(out_json),
        ],
        cwd=tmp_path,  # the script finds the package from its own location
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    failed = ""
    if proc.returncode != 0 and out_json.exists():
        saved = json.loads(out_json.read_text())
        failed = json.dumps(
            {k: v for k, v in saved.items() if isinstance(v, dict) and v.get("passed") is False},
            default=str,
        )[:4000]
    assert proc.returncode == 0, failed + proc.stdout[-3000:] + proc.stderr[-3000:]
    # The summary table comes last.
    last_lines = proc.stdout.strip().splitlines()[-3:]
    assert last_lines[-1].startswith("overall"), proc.stdout[-2000:]
    results = json.loads(out_json.read_text())
    assert json.loads((tmp_path / "out" / "gpu_results.json").read_text()) == results
    assert results["passed"] is True and results["complete"] is True
    assert results["settings"]["tiny"] is True
    assert (
        results["kernels"]["passed"] and results["kernels"]["num_passed"] == results["kernels"]["num_cases"]
    )
    thresholds = next(c for c in results["kernels"]["cases"] if c["name"] == "top-k/top-p thresholds")
    assert thresholds["ok"] and thresholds["rows_differing_in_kept_count"] == 0
    assert results["equivalence"]["vs_hf"]["passed"]
    assert results["equivalence"]["graphs_vs_eager"]["status"] == "skipped"
    throughput = results["throughput"]
    engine = throughput["engine"]
    assert engine["num_requests"] == 8 and engine["output_tokens"] == engine["expected_output_tokens"]
    assert engine["output_tokens_per_s"] > 0 and throughput["startup_s"] > 0
    again = throughput["engine_again"]
    assert again["output_tokens"] == engine["output_tokens"]
    # The per-step trace: buckets cover every step, within the run's time; the prefill phase is first.
    for run in (engine, again):
        buckets = run["steps_by_running"]
        assert buckets[0]["running"] == "requests waiting"
        assert sum(b["seconds"] for b in buckets) <= run["elapsed_s"]
        assert all(b["steps"] > 0 and b["max_ms"] >= b["ms_per_step"] > 0 for b in buckets)
        slowest = [s["ms"] for s in run["slowest_steps"]]
        assert slowest == sorted(slowest, reverse=True) and slowest[0] == max(b["max_ms"] for b in buckets)
        assert run["gc_pauses"]["count"] >= 0
    decode = results["decode"]
    assert decode["num_running"] == 8
    for key in ("step_ms", "forward_ms", "prepare_ms", "sample_ms", "host_overhead_fraction"):
        assert decode[key] is not None and decode[key] >= 0
    assert decode["sync_step_ms"] > 0 and decode["async_step_ms"] > 0
    assert 0 <= decode["async_overhead_fraction"] < 1 and 0 <= decode["sync_overhead_fraction"] < 1
    roofline = results["roofline"]
    assert roofline["bytes_per_step"] > roofline["weight_bytes"] > 0
    assert 0 < roofline["fraction_of_roofline_forward"]
    workload = roofline["workload"]
    assert 3 <= workload["decode_steps"] <= 15  # the longest output (4-16 tokens) less its first
    assert workload["ideal_output_tokens_per_s"] * workload["ideal_s"] == pytest.approx(
        engine["expected_output_tokens"]
    )
    assert workload["ideal_s"] == pytest.approx(workload["ideal_decode_s"] + workload["ideal_prefill_s"])
    assert workload["fraction_of_roofline"] == pytest.approx(
        engine["output_tokens_per_s"] / workload["ideal_output_tokens_per_s"]
    )
    serve = results["serve"]
    assert serve["passed"] and serve["server"]["output_tokens"] == serve["offline"]["output_tokens"] > 0
    assert serve["server_over_offline"] > 0
    hf = results["hf"]
    assert hf["hf"]["output_tokens_per_s"] > 0 and hf["engine"]["num_requests"] == hf["hf"]["num_requests"]
    assert "of the 8 workload requests" in hf["note"]
    # pagedllm serve as its own process tree, 1 and 2 front-ends, against the serve section's offline run.
    processes = results["serve_processes"]
    assert processes["passed"] and set(processes["runs_by_api_server_count"]) == {"1", "2"}
    for run in processes["runs_by_api_server_count"].values():
        assert run["failed"] == 0 and run["exit_status"] == 0 and run["processes_left_running"] == 0
        assert run["output_tokens"] == serve["offline"]["expected_output_tokens"]
        assert run["server_over_offline"] == pytest.approx(
            run["output_tokens_per_s"] / processes["offline_output_tokens_per_s"]
        )
        assert run["server_cpu_s"] > 0
