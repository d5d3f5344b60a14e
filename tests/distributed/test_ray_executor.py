"""Tensor parallelism with ``distributed_executor_backend="ray"``: rank 1 runs as a Ray actor in a
placement group of a local Ray instance; the tokens equal tensor parallel 1 and the logprobs agree;
after ``shutdown()`` no actor of the engine is alive and, after ``ray.shutdown()``, no process that
the test started is left."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from helpers.model_factory import make_tiny_hf_model
from helpers.processes import alive, describe, own_descendants, wait_gone
from pagedllm import LLM, SamplingParams

try:
    import ray
    import ray.exceptions
except ImportError as _exc:  # pragma: no cover - the 'ray' extra is installed by 'make install'
    pytest.skip(f"ray is not installed: pip install 'pagedllm[ray]' ({_exc})", allow_module_level=True)

pytestmark = pytest.mark.slow  # a Ray instance starts (5-15 s on 2 cores)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Roses are red,"]
PARAMS = SamplingParams(temperature=0, max_tokens=12, logprobs=5)
ENGINE_ARGS: dict[str, Any] = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 64}


def _rank_processes() -> list[psutil.Process]:
    """Live processes under this test process running a rank actor (Ray names them ray::RankActor)."""
    out = []
    for child in own_descendants():
        try:
            if "RankActor" in " ".join(child.cmdline()) and alive(child):
                out.append(child)
        except psutil.Error:
            pass
    return out


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A local Ray instance of 2 CPUs for this module; every process it started ends with it."""
    before = {p.pid for p in own_descendants()}
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False)
    except Exception as exc:  # noqa: BLE001 - e.g. no permission for its sockets, too little memory
        started = [p for p in own_descendants() if p.pid not in before]
        if ray.is_initialized():
            ray.shutdown()
        wait_gone(started, 30.0, "processes of a Ray that failed to start")
        pytest.skip(f"Ray cannot start on this machine: {type(exc).__name__}: {exc}")
    started = [p for p in own_descendants() if p.pid not in before]
    try:
        yield
    finally:
        started += [p for p in own_descendants() if p.pid not in before]
        ray.shutdown()
        wait_gone(started, 30.0, "Ray processes")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_hf_model(Path(tmp_path_factory.mktemp("ray_tp")), "llama", initializer_range=0.2)


def test_ray_tensor_parallel_matches_single_rank(local_ray: None, tiny_llama: str) -> None:
    threads = torch.get_num_threads()
    reference = LLM(tiny_llama, **ENGINE_ARGS)
    expected = reference.generate(PROMPTS, PARAMS, use_tqdm=False)
    reference.shutdown()

    llm = LLM(tiny_llama, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE_ARGS)
    try:
        ray_ranks = llm.llm_engine.executor.ray_ranks  # type: ignore[union-attr]
        assert ray_ranks is not None, "the ranks were placed by Ray"
        actors = [rank.actor for rank in ray_ranks.ranks]
        assert len(actors) == 1, "rank 1 is the only actor (the driver stays here)"
        rank_procs = _rank_processes()
        assert len(rank_procs) == 1, f"one rank actor process: {describe(rank_procs)}"
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
        torch.set_num_threads(threads)

    for prompt, got, want in zip(PROMPTS, outs, expected, strict=True):
        g, w = got.outputs[0], want.outputs[0]
        assert g.token_ids == w.token_ids, f"{prompt!r}: tensor parallel 2 (ray) differs from 1"
        assert g.logprobs is not None and w.logprobs is not None
        for step, (g_top, w_top) in enumerate(zip(g.logprobs, w.logprobs, strict=True)):
            assert set(g_top) == set(w_top), f"{prompt!r} step {step}: other top tokens"
            for token, lp in w_top.items():
                assert abs(g_top[token].logprob - lp.logprob) < 1e-4, (prompt, step, token)

    # The engine's actors are dead (a call fails at once) and their processes ended.
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.ping.remote(), timeout=30)
    wait_gone(rank_procs, 15.0, "rank actor processes")
    assert not _rank_processes(), "no rank actor process is left"
    # The placement group was removed: its CPU is free again.
    deadline = time.monotonic() + 10.0
    while ray.available_resources().get("CPU", 0.0) < 2.0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0.0) == 2.0, ray.available_resources()


def test_ranks_that_do_not_fit_fail_at_once(local_ray: None, tiny_llama: str) -> None:
    """Tensor parallel 4 needs 3 one-CPU bundles; the 2 CPUs of this Ray are refused before any
    actor starts, and nothing stays reserved."""
    threads = torch.get_num_threads()
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="bundle"):
            LLM(tiny_llama, tensor_parallel_size=4, distributed_executor_backend="ray", **ENGINE_ARGS)
    finally:
        torch.set_num_threads(threads)
    assert time.monotonic() - start < 30.0
    assert not _rank_processes()
    assert ray.available_resources().get("CPU", 0.0) == 2.0


def test_missing_ray_is_a_clear_error(tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # 'import ray' now fails
    threads = torch.get_num_threads()
    try:
        with pytest.raises(ValueError, match=r"distributed_executor_backend.*pip install 'pagedllm\[ray\]'"):
            LLM(tiny_llama, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE_ARGS)
    finally:
        torch.set_num_threads(threads)
