"""``pagedllm bench startup``: it times real server starts and stops, reports them, and leaves no
process behind; a server that cannot start is an error, not a figure."""

from __future__ import annotations

import json
from pathlib import Path

import psutil

from helpers.processes import own_descendants
from pagedllm.entrypoints.cli import main


def _serve_processes() -> list[psutil.Process]:
    found = []
    for proc in own_descendants():
        try:
            if "serve" in proc.cmdline():
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def test_startup_bench_times_starts_and_stops(tmp_path: Path) -> None:
    out = tmp_path / "startup.json"
    args = ["bench", "startup", "--repeats", "1", "--output-json", str(out), "--"]
    assert main([*args, "--max-model-len", "256", "--num-kv-blocks", "32"]) == 0
    data = json.loads(out.read_text())
    assert data["serve_args"] == ["--max-model-len", "256", "--num-kv-blocks", "32"]
    assert len(data["runs"]) == 1
    for key in ("start_s", "stop_s"):
        values = [run[key] for run in data["runs"]]
        assert all(v > 0 for v in values)
        assert data[key]["min"] == min(values) and min(values) <= data[key]["median"] <= max(values)
    assert _serve_processes() == []


def test_a_server_that_cannot_start_is_an_error() -> None:
    assert main(["bench", "startup", "--repeats", "1", "--", "--max-model-len", "-5"]) == 1
    assert _serve_processes() == []
