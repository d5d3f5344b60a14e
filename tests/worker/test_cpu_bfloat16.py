"""bfloat16 on the CPU (``dtype="bfloat16"``, ``quantization="none"``): weights and KV cache are held in
bfloat16 and the greedy tokens follow the float32 engine's by the top-5 rule (each token is among the
float32 engine's five most likely at that step, given the same prefix). They run through torch's
kernels, with a warning: the native CPU kernels are float32."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from pagedllm import SamplingParams

PROMPTS = ["The capital of France is", "def add(a, b):", "Water boils at"]


def test_bfloat16_weights_and_cache_follow_float32(
    make_llm: Any, float_llm: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        llm = make_llm(dtype="bfloat16", quantization="none", num_kv_blocks=64, max_model_len=512)
    # Not the native kernels: the user is told, and told what is faster.
    assert "bfloat16 on the CPU runs through torch's kernels" in caplog.text
    assert "dtype='float32' is several times faster" in caplog.text
    runner = llm.llm_engine.runner
    assert runner.kv_cache.storage.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in runner.model.parameters())
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for out in llm.generate(PROMPTS, greedy, use_tqdm=False):
        prompt_ids = list(out.prompt_token_ids)
        tokens = out.outputs[0].token_ids
        # Score the bf16 engine's tokens with the float32 engine, one step at a time.
        for i, token in enumerate(tokens):
            step = float_llm.generate(
                [prompt_ids + list(tokens[:i])],
                SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                use_tqdm=False,
            )[0].outputs[0]
            top5 = step.logprobs[0]  # greedy: the argmax is among the five, so exactly five
            assert len(top5) == 5
            assert token in top5, (out.prompt, i, token, sorted(top5))
    llm.llm_engine.check_idle()
    float_llm.llm_engine.check_idle()
