"""Fixtures of the tensor/pipeline-parallel tests: tiny checkpoints whose heads, KV heads and MLP
width split over the rank counts tested, and a watch on the processes a test starts."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

from helpers.model_factory import make_tiny_hf_model
from helpers.processes import alive, cmdline

# The module every rank process other than the driver runs (``python -m ... SPEC``).
RANK_MODULE = "pagedllm.worker.parallel_executor"

# name -> (architecture, config overrides). Every model has 2 layers (but "llama4l"), vocabulary 49152
# (divided by 2, 3 and 4) and sharp random logits (initializer_range 0.2), so greedy ties are unlikely.
TINY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # 4 query / 2 KV heads, MLP 128: TP 2 splits the KV heads, TP 4 replicates each on 2 ranks.
    "llama": ("llama", {}),
    # 6 query heads / 1 KV head (replicated on every rank), MLP 192: TP 3.
    "llama6": (
        "llama",
        {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 1, "intermediate_size": 192},
    ),
    # The LM head is the embedding: with PP, the first stage uses it to look tokens up and for logits.
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    # 4 layers: 3 pipeline stages, and stages of chosen sizes.
    "llama4l": ("llama", {"num_hidden_layers": 4}),
    # q/k/v biases.
    "qwen2": ("qwen2", {}),
    # q/k RMS norms, head_dim 32 (not hidden_size / heads).
    "qwen3": ("qwen3", {}),
    # Splits that do not work: 6 query / 2 KV heads on 3 ranks, an MLP of odd width on 2.
    "llama6_kv2": (
        "llama",
        {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2, "intermediate_size": 192},
    ),
    "llama_mlp129": ("llama", {"intermediate_size": 129}),
    # Architectures parallel ranks refuse.
    "gemma2": ("gemma2", {}),
    "mixtral": ("mixtral", {}),
}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """``tiny_model(name)``: the directory of the tiny checkpoint ``name`` of :data:`TINY_MODELS`
    (written once per session)."""
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            arch, overrides = TINY_MODELS[name]
            overrides = dict(overrides)
            tied = bool(overrides.pop("tie_word_embeddings", False))
            made[name] = make_tiny_hf_model(
                tmp_path_factory.mktemp(name),
                arch,
                tie_word_embeddings=tied,
                initializer_range=0.2,
                **overrides,
            )
        return made[name]

    return get


def _key(proc: psutil.Process) -> tuple[int, float]:
    try:
        return proc.pid, proc.create_time()
    except psutil.Error:
        return proc.pid, 0.0


def _parent(proc: psutil.Process) -> int | None:
    try:
        return proc.ppid()
    except psutil.Error:
        return None


class ProcessWatch:
    """The descendants of this (test) process that appeared since the watch started."""

    def __init__(self) -> None:
        self.me = psutil.Process()
        self.before = {_key(p) for p in self.me.children(recursive=True)}

    def new(self) -> list[psutil.Process]:
        """Descendants started since the watch began, still alive (zombies excluded)."""
        return [p for p in self.me.children(recursive=True) if _key(p) not in self.before and alive(p)]

    def ranks(self, parent: int | None = None) -> list[psutil.Process]:
        """New rank processes (``python -m pagedllm.worker.parallel_executor``) started by process
        ``parent`` (by default this one)."""
        parent = self.me.pid if parent is None else parent
        return [p for p in self.new() if RANK_MODULE in cmdline(p) and _parent(p) == parent]

    def describe(self, procs: list[psutil.Process]) -> list[tuple[int, str]]:
        return [(p.pid, cmdline(p)[:160]) for p in procs]

    def assert_none_left(self, timeout: float = 15.0) -> None:
        """Every process started since the watch began has exited (within ``timeout``)."""
        deadline = time.monotonic() + timeout
        while self.new() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = self.new()
        assert not left, f"processes left behind: {self.describe(left)}"

    def kill_new(self) -> None:
        for proc in self.new():
            try:
                proc.kill()
                proc.wait(5)
            except psutil.Error:
                pass


@pytest.fixture
def procs() -> Iterator[ProcessWatch]:
    """A :class:`ProcessWatch` started before the test; afterwards whatever the test started and left
    running is killed (so later tests are not disturbed) and the test fails."""
    watch = ProcessWatch()
    yield watch
    deadline = time.monotonic() + 10.0
    while watch.new() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = watch.describe(watch.new())
    watch.kill_new()
    assert not left, f"processes left behind: {left}"


@pytest.fixture
def failed_meeting() -> Iterator[None]:
    """For tests whose driver gives up on its ranks before they meet. Afterwards:

    - wait (at most 30 s) for the threads the driver left in the meeting
      (``pagedllm-the ranks were meeting``, blocked in torch.distributed until its own timeout):
      one that wakes while the interpreter is finalizing aborts the process (exit status 134,
      "terminate called without an active exception");
    """
    yield
    deadline = time.monotonic() + 30.0
    for thread in threading.enumerate():
        if thread.name.startswith("pagedllm-") and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))
