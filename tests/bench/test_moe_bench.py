"""``pagedllm bench moe`` at a tiny size through the CLI entry point, and its pieces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm.entrypoints.cli import main
from pagedllm_bench.moe import mixed_workload, moe_hf_config, parameter_counts

TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-heads", "4", "--num-kv-heads", "2",
    "--num-experts", "4", "--expert-intermediate-size", "32",
    "--num-requests", "5", "--min-prompt-len", "4", "--max-prompt-len", "20",
    "--min-output-len", "2", "--max-output-len", "6", "--baseline-batch-size", "2",
]  # fmt: skip


def test_bench_moe_reports_both_systems(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "moe.json"
    assert main(["bench", "moe", *TINY, "--output-json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "moe"
    model = data["model"]
    assert model["family"] == "mixtral" and model["num_experts"] == 4 and model["top_k"] == 2
    assert model["vocab_size"] == 49152  # the default model's tokenizer
    assert 0 < model["parameters"]["active_per_token"] < model["parameters"]["total"]
    workload = data["workload"]
    assert (
        workload["num_requests"] == 5 and 2 <= workload["output_len_min"] <= workload["output_len_max"] <= 6
    )
    ours, theirs = data["systems"]["pagedllm"], data["systems"]["hf-static"]
    # Both systems produce exactly the requested output tokens (EOS ignored).
    assert ours["output_tokens"] == theirs["output_tokens"] == workload["num_output_tokens"]
    assert theirs["batch_size"] == 2 and theirs["num_batches"] == 3
    assert len(ours["runs"]) == 2  # the engine ran before and after the baseline
    assert data["ratios"]["output_tokens_per_s"] == pytest.approx(
        ours["output_tokens_per_s"] / theirs["output_tokens_per_s"]
    )
    assert "pagedllm / transformers output tok/s" in capsys.readouterr().out


def test_bench_moe_refuses_bad_arguments() -> None:
    assert main(["bench", "moe", *TINY, "--top-k", "5"]) == 2
    assert main(["bench", "moe", *TINY, "--min-output-len", "9"]) == 2


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_configs_and_parameter_counts(family: str) -> None:
    config = moe_hf_config(
        family, vocab_size=1000, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        num_experts=8, top_k=2, expert_intermediate_size=32,
    )  # fmt: skip
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    counts = parameter_counts(config, family)
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert counts["total"] == sum(p.numel() for p in model.parameters()) - norms
    expert = 3 * 64 * 32
    assert counts["total"] - counts["active_per_token"] == 2 * (8 - 2) * expert


def test_mixed_workload_is_deterministic_and_mixed() -> None:
    a = mixed_workload(32, (16, 256), (16, 128), 49152, seed=0)
    assert [r.prompt_token_ids for r in a.requests] == [
        r.prompt_token_ids for r in mixed_workload(32, (16, 256), (16, 128), 49152, seed=0).requests
    ]
    lengths = [r.prompt_len for r in a.requests]
    assert min(lengths) >= 16 and max(lengths) <= 256 and max(lengths) - min(lengths) > 100
    assert all(100 <= t < 49152 for r in a.requests for t in r.prompt_token_ids)


def test_gpu_moe_script_runs_tiny_on_cpu(tmp_path: Path) -> None:
    """``benchmarks/gpu/run_moe.py --tiny --device cpu``: every figure of the section is there and
    consistent (the GPU run uses the same code at the Qwen3-30B-A3B layer shape)."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "moe_results.json"
    proc = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "gpu" / "run_moe.py"), "--tiny", "--device", "cpu",
         "--output-json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["complete"] is True
    moe = data["moe"]
    assert moe["settings"]["num_experts"] == 8 and moe["dtype"] == "float32"
    assert moe["engine"]["complete"] and moe["engine"]["num_requests"] == 6
    assert moe["engine_hf_subset"]["num_requests"] == moe["hf"]["num_requests"] == 3
    assert moe["hf"]["output_tokens"] > 0 and moe["engine_over_hf_output_tokens_per_s"] > 0
    decode = moe["decode"]
    assert decode["running"] == 4 and decode["step_s"] > 0
    assert 0 < decode["experts_touched_per_layer"] <= 8
    assert decode["floor_s"] == pytest.approx(
        (decode["weight_bytes"] + decode["kv_bytes"]) / decode["copy_bandwidth_bytes_per_s"]
    )
    assert "fraction of roofline" in proc.stdout
