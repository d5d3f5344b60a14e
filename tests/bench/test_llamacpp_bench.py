"""The llama.cpp comparison benchmarks without llama-cpp-python: its absence, the refusals, the
continuous batching of :func:`pagedllm_bench.llamacpp.run_batched` against a fake context, and the
engine side of ``pagedllm bench latency`` / ``perplexity`` through the CLI."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedllm.entrypoints.cli import main
from pagedllm_bench import llamacpp
from pagedllm_bench.latency import common_prefix
from pagedllm_bench.workloads import BenchRequest, random_workload

TINY_ENGINE = ["--num-kv-blocks", "64", "--max-model-len", "256", "--threads", "2"]


@pytest.fixture
def no_llama_cpp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import llama_cpp`` fail, as where the extra is not installed."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)


def test_missing_package_names_the_extra(no_llama_cpp: None) -> None:
    with pytest.raises(RuntimeError, match=r"pip install 'pagedllm-bench\[llamacpp\]'"):
        llamacpp.import_llama_cpp()
    with pytest.raises(ValueError, match=r"pagedllm-bench\[llamacpp\]"):
        llamacpp.check_baseline(None)


def test_baseline_needs_a_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="GGUF"):
        llamacpp.gguf_path(str(tmp_path))
    assert llamacpp.gguf_path(None).endswith(".gguf")


def test_baseline_is_greedy_only() -> None:
    with pytest.raises(ValueError, match="greedily"):
        llamacpp.check_baseline(None, temperature=0.7)


def test_split_baselines() -> None:
    assert llamacpp.split_baselines(None) == (None, False)
    assert llamacpp.split_baselines("llama.cpp-python") == (None, True)
    assert llamacpp.split_baselines("hf-static, llama.cpp-python,hf-cb") == ("hf-static,hf-cb", True)
    with pytest.raises(ValueError, match="llama.cpp-python"):
        llamacpp.split_baselines("vllm")
    # The bare name means the native tools, which run their own workloads: refused, pointing elsewhere.
    with pytest.raises(ValueError, match="bench scale"):
        llamacpp.split_baselines("hf-cb,llama.cpp")


@pytest.mark.parametrize(
    ("command", "baseline"),
    [("latency", "llama.cpp-python"), ("perplexity", "llama.cpp-python"), ("latency", "llama.cpp")],
)
def test_cli_refuses_llama_cpp_on_a_hf_checkpoint(
    command: str, baseline: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "config.json").write_text("{}")
    with caplog.at_level(logging.ERROR, logger="pagedllm_bench"):
        assert main(["bench", command, "--baseline", baseline, "--model", str(tmp_path)]) == 2
    assert f"--baseline {baseline} needs a GGUF model file" in caplog.text


@pytest.mark.parametrize("command", ["perplexity", "throughput"])
def test_cli_refuses_the_native_name(command: str, caplog: pytest.LogCaptureFixture) -> None:
    """``--baseline llama.cpp`` means the native tools: refused before any model loads, naming the
    binding's name and the command that compares with the native tools."""
    with caplog.at_level(logging.ERROR, logger="pagedllm_bench"):
        assert main(["bench", command, "--baseline", "llama.cpp"]) == 2
    assert "--baseline llama.cpp-python" in caplog.text
    assert "pagedllm bench scale" in caplog.text


def test_cli_names_the_extra_when_absent(no_llama_cpp: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="pagedllm_bench"):
        assert (
            main(["bench", "throughput", "--baseline", "hf-cb,llama.cpp-python", "--num-prompts", "1"]) == 2
        )
    assert "pip install 'pagedllm-bench[llamacpp]'" in caplog.text


# ------------------------------------------------------------------------------------------------
# Continuous batching against a fake llama.cpp context
# ------------------------------------------------------------------------------------------------

VOCAB = 50


def _next_token(history: Sequence[int]) -> int:
    """The fake model's greedy choice: depends on the whole sequence so far."""
    return (sum(history) * 7 + len(history)) % VOCAB


def _reference(req: BenchRequest, stop: set[int]) -> list[int]:
    history, out = list(req.prompt_token_ids), list[int]()
    while len(out) < req.output_len:
        token = _next_token(history)
        out.append(token)
        history.append(token)
        if token in stop:
            break
    return out


class _FakeLib:
    def __init__(self, n_seq_max: int) -> None:
        self.n_seq_max = n_seq_max

    def llama_n_seq_max(self, ctx: Any) -> int:
        return self.n_seq_max


class FakeContext:
    """Keeps each sequence's tokens by position, checks what llama.cpp would refuse, and returns
    logits whose argmax is :func:`_next_token` of the sequence so far."""

    def __init__(self, n_seq_max: int, n_batch: int) -> None:
        self.lib = _FakeLib(n_seq_max)
        self.ctx = object()
        self.n_batch = n_batch
        self.n_ctx = 1024
        self.seqs: dict[int, list[int]] = {}
        self.calls: list[int] = []
        self.peak_live = 0

    def clear(self) -> None:
        self.seqs.clear()

    def remove_sequence(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)

    def decode(
        self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int], outputs: Sequence[bool]
    ) -> np.ndarray:
        assert 0 < len(tokens) <= self.n_batch
        assert len(tokens) == len(positions) == len(seq_ids) == len(outputs)
        self.calls.append(len(tokens))
        rows = []
        for token, pos, seq, out in zip(tokens, positions, seq_ids, outputs, strict=True):
            assert 0 <= seq < self.lib.n_seq_max
            history = self.seqs.setdefault(seq, [])
            assert pos == len(history), "positions of a sequence must follow on"
            history.append(token)
            if out:
                row = np.zeros(VOCAB, dtype=np.float32)
                row[_next_token(history)] = 1.0
                rows.append(row)
        self.peak_live = max(self.peak_live, len(self.seqs))
        return np.array(rows, dtype=np.float32).reshape(len(rows), VOCAB)


@pytest.mark.parametrize(("max_num_seqs", "budget"), [(1, 8), (3, 8), (4, 64), (16, 16)])
def test_run_batched_matches_one_at_a_time(max_num_seqs: int, budget: int) -> None:
    workload = random_workload(9, (3, 20), (1, 12), VOCAB, seed=max_num_seqs)
    ctx = FakeContext(min(max_num_seqs, 9), budget)
    run = llamacpp.run_batched(ctx, workload.requests, max_num_seqs, budget)  # type: ignore[arg-type]
    assert run.outputs == [_reference(r, set()) for r in workload.requests]
    assert [len(o) for o in run.outputs] == [r.output_len for r in workload.requests]
    assert ctx.peak_live <= max_num_seqs
    assert max(ctx.calls) <= budget
    assert not ctx.seqs, "finished sequences leave the cache"
    # Prefill chunks fill the budget when there is prompt left: fewer calls than tokens.
    assert run.num_decode_calls < workload.num_prompt_tokens + workload.num_output_tokens


def test_run_batched_stops_at_eos_when_asked() -> None:
    workload = random_workload(5, (4, 8), (30, 30), VOCAB, seed=3)
    stop = {_reference(r, set())[4] for r in workload.requests[:2]}
    ctx = FakeContext(5, 64)
    run = llamacpp.run_batched(ctx, workload.requests, 5, 64, sorted(stop))  # type: ignore[arg-type]
    assert run.outputs == [_reference(r, stop) for r in workload.requests]
    assert len(run.outputs[0]) <= 5


def test_run_batched_refuses_a_budget_below_the_slots() -> None:
    workload = random_workload(4, (4, 4), (2, 2), VOCAB)
    with pytest.raises(ValueError, match="cannot hold"):
        llamacpp.run_batched(FakeContext(4, 3), workload.requests, 4, 3)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# The engine side through the CLI
# ------------------------------------------------------------------------------------------------


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3, 4], [1, 2, 5, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_latency_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "latency.json"
    args = ["bench", "latency", "--input-len", "24", "--output-len", "5", "--repeats", "2"]
    assert main([*args, *TINY_ENGINE, "--output-json", str(out)]) == 0
    data = json.loads(out.read_text())
    engine = data["systems"]["pagedllm"]
    assert len(engine["runs"]) == 2
    assert engine["prompt_tokens_per_s"] > 0 and engine["decode_tokens_per_s"] > 0
    assert len(engine["output_tokens"]) == 5
    assert engine["cpu_cores_used"] > 0.0  # (how much depends on what else the machine runs)
    assert data["threads"] == 2 and data["ratios"] is None
    assert data["engine_dtype"] in ("float32", "bfloat16", "float16")
    assert "prompt tok/s" in capsys.readouterr().out


def test_perplexity_cli(tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    out = tmp_path / "ppl.json"
    args = ["bench", "perplexity", str(text), "--context", "32", "--max-windows", "3"]
    assert main([*args, *TINY_ENGINE, "--output-json", str(out)]) == 0
    data = json.loads(out.read_text())
    result = data["systems"]["pagedllm"]
    assert data["bos_token_id"] is None and result["num_windows"] == 3
    assert data["engine_dtype"] in ("float32", "bfloat16", "float16")
    assert result["tokens_scored"] == 3 * 31
    assert result["cpu_cores_used"] > 0.0
    # A repeated sentence is easy to predict after its first occurrence, but not trivially so.
    assert 1.0 < result["perplexity"] < 50.0
