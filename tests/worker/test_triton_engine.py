"""The engine on the Triton attention backend (the Triton interpreter on CPU) against the torch backend."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from pagedllm import SamplingParams  # noqa: E402

pytest.importorskip("triton")

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.mark.slow
def test_triton_backend_greedy_matches_torch_backend(make_llm: Callable[..., Any]) -> None:
    """Two short prompts, four greedy tokens each, in float32 (the interpreter is slow)."""
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5)
    common = {
        "device": "cpu",
        "dtype": "float32",
        "num_kv_blocks": 32,
        "max_model_len": 256,
        # Float weights: int8 activation rounding would turn the backends' last-bit differences into
        # visible ones.
        "quantization": "none",
    }
    torch_llm = make_llm(attention_backend="torch", **common)
    triton_llm = make_llm(attention_backend="triton", **common)
    assert torch_llm.llm_engine.runner.backend.name == "torch"
    assert triton_llm.llm_engine.runner.backend.name == "triton"
    expected = torch_llm.generate(PROMPTS, params, use_tqdm=False)
    actual = triton_llm.generate(PROMPTS, params, use_tqdm=False)
    for exp, act in zip(expected, actual, strict=True):
        assert act.prompt_token_ids == exp.prompt_token_ids
        assert act.outputs[0].token_ids == exp.outputs[0].token_ids
        for step_exp, step_act in zip(exp.outputs[0].logprobs, act.outputs[0].logprobs, strict=True):
            assert step_exp.keys() == step_act.keys()
            for tok, lp in step_exp.items():
                assert abs(step_act[tok].logprob - lp.logprob) < 1e-3
    triton_llm.llm_engine.check_idle()
