"""Qwen2 (qkv bias), Qwen3 (q/k RMSNorm) and Llama tiny random models: HF directory loading and
greedy equality with HF transformers, including chunked prefill and a decode batch."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.model_factory import make_tiny_hf_model
from helpers.reference import assert_greedy_close, hf_greedy
from pagedllm import LLM, SamplingParams

PROMPTS = [
    "Hello there, how are you today?",
    "The tiny model says",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
]


@pytest.mark.parametrize(
    "arch, tied", [("qwen2", False), ("qwen3", False), ("qwen3", True), ("llama", False)]
)
def test_tiny_model_matches_hf(tmp_path, arch, tied):
    path = make_tiny_hf_model(tmp_path, arch, tie_word_embeddings=tied, initializer_range=0.2)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, num_kv_blocks=64, block_size=8, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    tok = llm.get_tokenizer()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok(prompt).input_ids
        assert out.prompt_token_ids == ids
        hf_tokens, hf_top = hf_greedy(hf, ids, 12)
        o = out.outputs[0]
        assert_greedy_close(o.token_ids, o.logprobs, hf_tokens, hf_top, f"{arch} {prompt!r}")
        for t, lp in hf_top[0].items():
            assert abs(o.logprobs[0][t].logprob - lp) < 1e-3
    llm.llm_engine.check_idle()
