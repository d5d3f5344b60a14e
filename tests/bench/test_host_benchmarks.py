"""The host-work benchmarks of the GPU decode path (``benchmarks/gpu/host_step.py`` and
``host_serve.py``), small and on CPU: their figures are consistent, and the server run leaves the
engine idle (the script checks that every KV block is free)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_script(name: str, args: list[str], tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "gpu" / name), *args, "--output-json", str(out)],
        cwd=tmp_path,  # the scripts find the package from their own location
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.mark.slow
def test_host_serve_small(tmp_path: Path) -> None:
    n, tokens = 8, 24
    r = run_script("host_serve.py", ["--requests", str(n), "--max-tokens", str(tokens)], tmp_path)
    for phase in ("engine_cumulative", "engine_final_only", "server_stream", "server_no_stream"):
        p = r[phase]
        assert p["steps"] >= 5, phase
        assert p["wall_ms"] >= p["sampler_ms"] > 0 and p["host_ms"] == pytest.approx(
            p["wall_ms"] - p["sampler_ms"]
        )
        assert p["engine_thread_cpu_ms"] > 0
    # A response that is not streamed is one event; a stream is its role chunk, its text chunks (at
    # most one per token) and its end.
    assert r["server_no_stream"]["events"] == n
    assert 3 * n <= r["server_stream"]["events"] <= (tokens + 3) * n


@pytest.mark.slow
def test_host_step_small(tmp_path: Path) -> None:
    r = run_script("host_step.py", ["--batch-size", "8", "--steps", "8"], tmp_path)
    for kind in ("final_only", "cumulative"):
        for mode in ("sync", "ahead"):
            p = r[f"{kind}_{mode}"]
            phases = sum(p[f"{name}_ms"] for name in ("schedule", "prepare", "sample", "outputs"))
            assert 0 < phases <= p["step_ms"] * 1.05, (kind, mode, p)  # parts of a step
            assert p["host_ms"] == pytest.approx(p["step_ms"] - p["sample_ms"])
    assert r["sampler_host_ms_vocab64"] > 0


def test_tune_attention_runs_small_on_cpu(tmp_path: Path) -> None:
    """The attention tiling sweep, small and interpreted: every tiling agrees with the default one
    and is timed, and the default tiling is reported."""
    out = tmp_path / "tune.json"
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/gpu/tune_attention.py",
            "--tiny",
            "--device",
            "cpu",
            "--reps",
            "1",
            "--output-json",
            str(out),
        ],
        cwd=REPO_ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    (batch,) = results["batches"]
    assert batch["num_seqs"] == 4 and batch["kv_bytes"] > 0
    assert batch["default"]["ms"] > 0 and {"tile_n", "num_splits", "num_warps"} <= set(batch["default"])
    assert len(batch["rows"]) == 2 and all(r["ms"] > 0 and r["max_diff"] < 1e-4 for r in batch["rows"])
    assert batch["best"] in batch["rows"]
