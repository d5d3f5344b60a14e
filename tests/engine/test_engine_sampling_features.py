"""n > 1 sharing the prompt's KV blocks, prompt logprobs, logit bias, bad words, allowed ids."""

from __future__ import annotations

import torch

from pagedllm import SamplingParams

LONG_PROMPT = "Here is a long shared prompt about gardens and rivers. " * 8


def peak_blocks(llm, prompt, params):
    engine = llm.llm_engine
    engine.reset_prefix_cache()
    engine.add_request("peak", prompt, params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.get_stats()
        peak = max(peak, stats.num_kv_blocks - stats.num_free_blocks)
    engine.check_idle()
    return peak


def test_n_samples_share_prompt_blocks(default_llm):
    one = peak_blocks(default_llm, LONG_PROMPT, SamplingParams(n=1, max_tokens=4, ignore_eos=True, seed=1))
    eight = peak_blocks(default_llm, LONG_PROMPT, SamplingParams(n=8, max_tokens=4, ignore_eos=True, seed=1))
    assert eight < 3 * one, f"n=8 used {eight} blocks vs {one} for n=1"


def test_prompt_logprobs_match_a_full_forward(float_llm, hf_default):
    model, tokenizer = hf_default
    prompt = "The quick brown fox jumps over the lazy dog."
    out = float_llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    ids = tokenizer(prompt).input_ids
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    for i in range(1, len(ids)):
        entry = out.prompt_logprobs[i]
        assert ids[i] in entry and 2 <= len(entry) <= 3
        assert abs(entry[ids[i]].logprob - float(ref[i - 1, ids[i]])) < 1e-3
    float_llm.llm_engine.check_idle()


def test_logit_bias_forces_a_token(default_llm):
    tok = default_llm.get_tokenizer()
    target = tok.encode(" banana", add_special_tokens=False)[0]
    out = default_llm.generate(
        ["My favourite colour is"], SamplingParams(temperature=0, max_tokens=5, logit_bias={target: 100})
    )[0].outputs[0]
    assert out.token_ids == [target] * 5


def test_bad_words_never_emitted(default_llm):
    free = default_llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=12))[
        0
    ].outputs[0]
    assert "Paris" in free.text
    banned = default_llm.generate(
        ["The capital of France is"], SamplingParams(temperature=0, max_tokens=12, bad_words=["Paris"])
    )[0].outputs[0]
    assert "Paris" not in banned.text


def test_allowed_token_ids_restrict_output(default_llm):
    allowed = [28, 30, 216]
    out = default_llm.generate(
        ["Say something:"], SamplingParams(temperature=1.0, seed=3, max_tokens=6, allowed_token_ids=allowed)
    )[0].outputs[0]
    assert set(out.token_ids) <= set(allowed)
    default_llm.llm_engine.check_idle()
