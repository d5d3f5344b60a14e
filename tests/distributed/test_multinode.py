"""A model split over two "machines" on 127.0.0.1: node 1 is ``pagedllm serve --nnodes 2 --node-rank 1``
(a process of its own, which runs its ranks and no engine), node 0 is ``LLM(..., nnodes=2,
node_rank=0)`` in this process. Greedy tokens and top logprobs equal one rank's; when node 0 shuts
down, node 1 exits with status 0. A node whose partner never comes fails after the timeout."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from helpers.server import REPO_ROOT, free_port
from pagedllm import LLM, SamplingParams
from pagedllm.outputs import RequestOutput

# The engine arguments of both nodes (node 1 gets them as flags).
ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "block_size": 16,
    "num_kv_blocks": 32,
    "max_model_len": 256,
}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three prime numbers:"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, logprobs=5, ignore_eos=True)
TIMEOUT_S = 60.0  # distributed_timeout_s of both nodes
EXIT_WITHIN_S = 30.0  # node 1 exits this soon after node 0 shuts down


def flags(args: dict[str, Any]) -> list[str]:
    out = []
    for name, value in args.items():
        out += ["--" + name.replace("_", "-"), str(value)]
    return out


@dataclass
class WorkerNode:
    proc: subprocess.Popen[bytes]
    log: Path

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])

    def exit_status(self, timeout: float) -> int:
        """The process's exit status, waiting at most ``timeout`` (failing the test past it)."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node 1 still running after {timeout:g} s:\n{self.log_tail()}")


@contextmanager
def worker_node(
    model: str, tp: int, pp: int, port: int, timeout_s: float = TIMEOUT_S
) -> Iterator[WorkerNode]:
    """Node 1 as a ``pagedllm serve`` process (output in a log file); killed if still running at the
    end."""
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model]
    cmd += flags({"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "nnodes": 2, "node_rank": 1})
    cmd += flags({"master_addr": "127.0.0.1", "master_port": port, "distributed_timeout_s": timeout_s})
    cmd += flags(ENGINE_ARGS)
    with tempfile.NamedTemporaryFile(prefix="pagedllm-node1-", suffix=".log") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield WorkerNode(proc, Path(log.name))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


_reference: list[RequestOutput] = []


def one_rank(model: str) -> list[RequestOutput]:
    if not _reference:
        _reference.extend(LLM(model, **ENGINE_ARGS).generate(PROMPTS, GREEDY, use_tqdm=False))
    return _reference


def assert_same(ref: list[RequestOutput], got: list[RequestOutput]) -> None:
    """The same tokens; the same top logprobs within 1e-4 (a token may be missing on one side only
    where it ties with that side's smallest entry)."""
    for r, g in zip(ref, got, strict=True):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert r.outputs[0].logprobs is not None and g.outputs[0].logprobs is not None
        for rt, gt in zip(r.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            smallest = min(lp.logprob for lp in gt.values())
            for token, lp in rt.items():
                other = gt[token].logprob if token in gt else smallest
                assert abs(other - lp.logprob) < 1e-4, (token, lp, gt)


@pytest.mark.parametrize(
    "tp,pp",
    [
        pytest.param(2, 1, id="tp2"),
        pytest.param(1, 2, id="pp2"),
        # 4 ranks, 2 a machine: node 1 runs rank 2 itself and starts rank 3 as a process.
        pytest.param(2, 2, id="tp2-pp2", marks=pytest.mark.slow),
    ],
)
def test_two_nodes_equal_one_rank(tp: int, pp: int, tiny_model: Callable[[str], str], procs: Any) -> None:
    model = tiny_model("llama")
    ref = one_rank(model)
    port = free_port()
    with worker_node(model, tp, pp, port) as node1:
        llm = LLM(
            model,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            nnodes=2,
            node_rank=0,
            master_addr="127.0.0.1",
            master_port=port,
            distributed_timeout_s=TIMEOUT_S,
            **ENGINE_ARGS,
        )
        try:
            # This machine runs ranks 0 .. tp*pp/2 - 1: the driver and tp*pp/2 - 1 rank processes.
            assert len(procs.ranks()) == tp * pp // 2 - 1, procs.describe(procs.new())
            assert node1.proc.poll() is None, node1.log_tail()
            got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            llm.llm_engine.check_idle()
            assert_same(ref, got)
        finally:
            llm.shutdown()
        # Node 1 exits, successfully, soon after node 0 shut down.
        assert node1.exit_status(EXIT_WITHIN_S) == 0, node1.log_tail()
    procs.assert_none_left()


@pytest.mark.slow
def test_worker_node_without_driver_fails_after_timeout(tiny_model: Callable[[str], str], procs: Any) -> None:
    """Node 1 waits for node 0 at most ``--distributed-timeout-s``, then exits with status 1."""
    timeout_s = 5.0
    started = time.monotonic()
    with worker_node(tiny_model("llama"), 2, 1, free_port(), timeout_s=timeout_s) as node1:
        assert node1.exit_status(timeout_s + 40.0) == 1, node1.log_tail()
        assert "Rank 1 stopped" in node1.log_tail()
    assert time.monotonic() - started >= timeout_s
    procs.assert_none_left()


def test_driver_without_worker_node_fails_after_timeout(
    tiny_model: Callable[[str], str], procs: Any, failed_meeting: None
) -> None:
    """Node 0 waits for node 1 at most ``distributed_timeout_s``, then ``LLM(...)`` raises."""
    timeout_s = 5.0
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="distributed_timeout_s"):
        LLM(
            tiny_model("llama"),
            tensor_parallel_size=2,
            nnodes=2,
            master_port=free_port(),
            distributed_timeout_s=timeout_s,
            **ENGINE_ARGS,
        )
    took = time.monotonic() - started
    assert timeout_s <= took < timeout_s + 15.0
    procs.assert_none_left()
