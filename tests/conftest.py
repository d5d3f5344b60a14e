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

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


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
