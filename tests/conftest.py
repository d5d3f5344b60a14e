"""Shared fixtures: the default model loaded once per session, the HF reference, engine factories."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import pagedllm.worker.executor as executor_module  # noqa: E402
from pagedllm.model.loader import LoadedCheckpoint, default_model_path, load_checkpoint  # noqa: E402
from pagedllm.utils import PORT_RANGE_ENV, port_spans  # noqa: E402

# Under pytest-xdist the cores are shared among the worker processes.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))


def _worker_port_range() -> None:
    """Give each xdist worker (and every process its tests start) its own slice of the ports below
    the ephemeral range: a port one worker's server has chosen but not yet bound is never chosen by
    another's."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker or PORT_RANGE_ENV in os.environ:
        return
    low, high = port_spans()[0]  # the default span below the ephemeral range
    width = (high - low + 1) // _WORKERS
    start = low + int(worker.removeprefix("gw")) * width
    os.environ[PORT_RANGE_ENV] = f"{start}-{start + width - 1}"


_worker_port_range()


@functools.cache
def cached_checkpoint(
    model: str | None, tokenizer: str | None = None, keep_quantized: bool = False
) -> LoadedCheckpoint:
    """Float weights are copied into each engine's own parameters and GGUF blocks are read-only, so
    one loaded copy serves all tests."""
    return load_checkpoint(model, tokenizer, keep_quantized)


@pytest.fixture(autouse=True, scope="session")
def _share_checkpoints() -> Iterator[None]:
    original = executor_module.load_checkpoint
    executor_module.load_checkpoint = cached_checkpoint  # type: ignore[assignment]
    yield
    executor_module.load_checkpoint = original  # type: ignore[assignment]


@pytest.fixture(autouse=True, scope="module")
def _test_file_leaves_no_process() -> Iterator[None]:
    """Every process a test file starts (servers, engine cores, ranks, browsers) is gone once its
    tests and fixtures are done; the session-scoped fixtures' servers are left out."""
    from helpers.processes import alive, own_descendants, wait_gone

    before = {p.pid for p in own_descendants()}
    yield
    left = [p for p in own_descendants() if p.pid not in before and alive(p)]
    if left:
        wait_gone(left, timeout=15.0, what="processes this test file left running")


@pytest.fixture(autouse=True)
def _subnormals_stay_on() -> Iterator[None]:
    """No test may leave this process flushing subnormal floats to zero (loading a library linked
    with -ffast-math does that), which would change the arithmetic of every test after it."""
    yield
    smallest = 5e-324
    assert smallest > 0, "this test left subnormal floats flushed to zero in the test process"


@pytest.fixture(scope="session")
def make_llm() -> Callable[..., Any]:
    """Build an ``LLM`` with engine arguments; small KV pool by default to keep memory low."""
    from pagedllm import LLM

    def make(model: str | None = None, **kwargs: Any) -> LLM:
        kwargs.setdefault("num_kv_blocks", 512)
        kwargs.setdefault("max_model_len", 2048)
        return LLM(model, **kwargs)

    return make


@pytest.fixture(scope="session")
def default_llm(make_llm: Callable[..., Any]) -> Any:
    """The default model as a user gets it: its GGUF blocks run by the quantized kernels."""
    return make_llm()


@pytest.fixture(scope="session")
def tool_llm(make_llm: Callable[..., Any]) -> Any:
    """The default model with the shipped Hermes-style tool template as its chat template."""
    from helpers.server import TOOL_TEMPLATE

    return make_llm(chat_template=str(TOOL_TEMPLATE), num_kv_blocks=128)


@pytest.fixture(scope="session")
def float_llm(make_llm: Callable[..., Any]) -> Any:
    """The default model dequantized to float32 (``quantization="none"``): the engine that is compared
    with HF transformers token for token."""
    return make_llm(quantization="none")


@pytest.fixture(scope="session")
def hf_default() -> tuple[Any, Any]:
    """HF transformers' own GGUF loading of the default model (fp32, CPU) and its tokenizer."""
    from transformers import AutoModelForCausalLM

    from helpers.model_factory import default_tokenizer

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    return model, default_tokenizer()
