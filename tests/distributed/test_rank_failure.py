"""A rank that dies or hangs fails the next step with a RuntimeError within the distributed timeout
(plus the bounded shutdown), every other rank is stopped, and no process is left behind; the engine
keeps refusing steps afterwards instead of hanging."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import psutil
import pytest

import pagedllm.worker.parallel_executor as parallel_executor
from pagedllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ENGINE_ARGS: dict[str, Any] = {"dtype": "float32", "num_kv_blocks": 32, "max_model_len": 256}
# What the driver's shutdown may add to a failed step: the SHUTDOWN command (bounded by 5 s) and the
# wait for the ranks to exit (5 s) before they are killed.
SHUTDOWN_GRACE_S = 12.0


def start_tp2(model: str, procs: Any, timeout_s: float) -> tuple[LLM, psutil.Process, list[int]]:
    """A TP 2 engine that has generated once; its rank-1 process; the first reference tokens."""
    llm = LLM(model, tensor_parallel_size=2, distributed_timeout_s=timeout_s, **ENGINE_ARGS)
    first = llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert len(first) == 8
    ranks = procs.ranks()
    assert len(ranks) == 1, procs.describe(procs.new())
    return llm, ranks[0], first


def fails_then(llm: LLM, limit_s: float) -> float:
    """The next generate raises RuntimeError within ``limit_s``; returns how long it took."""
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="parallel step failed"):
        llm.generate(["Another prompt"], GREEDY, use_tqdm=False)
    took = time.monotonic() - started
    assert took < limit_s, f"the failure took {took:.1f} s"
    return took


def test_killed_rank_fails_the_step(tiny_model: Callable[[str], str], procs: Any) -> None:
    llm, rank1, _ = start_tp2(tiny_model("llama"), procs, timeout_s=20)
    try:
        os.kill(rank1.pid, signal.SIGKILL)
        fails_then(llm, 30.0)
        procs.assert_none_left()
        # The ranks are gone: later steps fail at once rather than wait on them.
        started = time.monotonic()
        with pytest.raises(RuntimeError):
            llm.generate(["Once more"], GREEDY, use_tqdm=False)
        assert time.monotonic() - started < 5.0
    finally:
        llm.shutdown()
    procs.assert_none_left()


@pytest.mark.slow
def test_hung_rank_fails_the_step(tiny_model: Callable[[str], str], procs: Any) -> None:
    """A stopped (SIGSTOP) rank answers nothing: the collective times out after
    ``distributed_timeout_s`` and the stopped process is killed (SIGKILL works on it)."""
    timeout_s = 10.0
    llm, rank1, _ = start_tp2(tiny_model("llama"), procs, timeout_s=timeout_s)
    try:
        os.kill(rank1.pid, signal.SIGSTOP)
        took = fails_then(llm, timeout_s + SHUTDOWN_GRACE_S)
        assert took >= timeout_s * 0.9  # it waited for the timeout: the rank was not seen dead
        procs.assert_none_left()
    finally:
        try:
            os.kill(rank1.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        llm.shutdown()
    procs.assert_none_left()


def test_rank_killed_while_idle_then_shutdown(tiny_model: Callable[[str], str], procs: Any) -> None:
    """Shutting down an engine whose rank already died returns promptly and leaves nothing."""
    llm, rank1, _ = start_tp2(tiny_model("llama"), procs, timeout_s=20)
    os.kill(rank1.pid, signal.SIGKILL)
    started = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - started < SHUTDOWN_GRACE_S
    procs.assert_none_left()


def exiting_rank(config: Any, rank: int, master_port: int) -> parallel_executor.RankProcess:
    """A rank process that exits with status 3 at once (as one failing at import would)."""
    proc = object.__new__(parallel_executor.RankProcess)
    proc.rank = rank
    proc.popen = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    return proc


def fail_start_up(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``LLM(...)`` with TP 2 whose rank 1 dies before the ranks meet raises RuntimeError well before
    ``distributed_timeout_s``: the driver sees the process exit."""
    timeout_s = 6.0
    with monkeypatch.context() as patch:
        patch.setattr(parallel_executor, "start_rank_process", exiting_rank)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="a rank exited \\(status 3\\)"):
            LLM(model, tensor_parallel_size=2, distributed_timeout_s=timeout_s, **ENGINE_ARGS)
        assert time.monotonic() - started < timeout_s / 2


def test_rank_dying_at_start_up_fails_fast(
    tiny_model: Callable[[str], str], procs: Any, monkeypatch: pytest.MonkeyPatch, failed_meeting: None
) -> None:
    fail_start_up(tiny_model("llama"), monkeypatch)
    procs.assert_none_left()


@pytest.mark.slow
def test_new_engine_after_failed_start_up(
    tiny_model: Callable[[str], str], procs: Any, monkeypatch: pytest.MonkeyPatch, failed_meeting: None
) -> None:
    """A failed start-up does not spoil the process: a new TP 2 engine starts and generates."""
    fail_start_up(tiny_model("llama"), monkeypatch)
    procs.assert_none_left()
    llm, _, first = start_tp2(tiny_model("llama"), procs, timeout_s=10)
    try:
        again = llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert again == first
    finally:
        llm.shutdown()
    procs.assert_none_left()
