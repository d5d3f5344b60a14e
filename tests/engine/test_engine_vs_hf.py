"""The engine against HF transformers on the same weights (fp32 CPU), by vLLM's rule."""

from __future__ import annotations

import pytest

from helpers.prompts import REFERENCE_PROMPTS as PROMPTS
from helpers.reference import assert_greedy_close, hf_greedy
from pagedllm import SamplingParams


@pytest.mark.slow
def test_greedy_matches_hf_on_default_model(float_llm, hf_default):
    model, tokenizer = hf_default
    chat = float_llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Name a colour."}], tokenize=False, add_generation_prompt=True
    )
    prompts = PROMPTS + [chat]
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=5)
    outs = float_llm.generate(prompts, params, use_tqdm=False)
    identical = 0
    for prompt, out in zip(prompts, outs, strict=True):
        expected_ids = tokenizer(prompt).input_ids
        assert out.prompt_token_ids == expected_ids, "prompt token ids equal the tokenizer's"
        hf_tokens, hf_top = hf_greedy(model, expected_ids, 32)
        ours = out.outputs[0]
        identical += assert_greedy_close(ours.token_ids, ours.logprobs, hf_tokens, hf_top, prompt)
        # Our reported logprobs of HF's top tokens agree with HF's values (first step).
        for tok, lp in hf_top[0].items():
            if tok in ours.logprobs[0]:
                assert abs(ours.logprobs[0][tok].logprob - lp) < 1e-3
    assert identical >= len(prompts) - 2, "near-tie flips are rare"
    float_llm.llm_engine.check_idle()
