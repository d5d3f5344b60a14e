"""The native decode layers (:mod:`pagedllm.model.cpu_decode`): every decode-only step they run gives
the Python forward's hidden states, on the default model (GQA 3, head_dim 64) and on a tiny Qwen2
(q/k/v bias, head_dim 16), with requests of many lengths sharing steps and leaving at different
times; models and settings they do not cover take the Python forward."""

from __future__ import annotations

import pytest

from helpers.model_factory import make_tiny_hf_model
from helpers.native_decode import CheckedNativeDecode
from pagedllm import SamplingParams
from pagedllm.kernels.cpu.library import kernels_available

needs_native = pytest.mark.skipif(not kernels_available(), reason="no C compiler for the CPU kernels")


@needs_native
@pytest.mark.parametrize("model", ["default", "qwen2"])
def test_native_decode_matches_python_forward(make_llm, tmp_path, model: str) -> None:
    if model == "default":
        llm = make_llm()
        prompts = [
            "The quick brown fox",
            "Once upon a time, in a land far away, there lived a",
            "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17,",
            "Hi",
        ]
    else:
        path = make_tiny_hf_model(tmp_path, "qwen2", initializer_range=0.2)
        llm = make_llm(path, num_kv_blocks=64, block_size=8, max_num_batched_tokens=64, max_model_len=512)
        prompts = [
            "Hello there, how are you today?",
            "The tiny model says",
            "a b c d e f g h i j k l m n o p q",
        ]
    runner = llm.llm_engine.runner
    assert runner.native_decode is not None
    checked = CheckedNativeDecode(runner)
    runner.native_decode = checked
    try:
        params = [
            SamplingParams(temperature=0, max_tokens=6 + 5 * i, ignore_eos=True) for i in range(len(prompts))
        ]
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.native_decode = checked.native
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    # Steps of every batch size from all requests down to the last one ran natively.
    assert set(checked.batch_sizes) == set(range(1, len(prompts) + 1))
    llm.llm_engine.check_idle()


@needs_native
def test_native_decode_greedy_equals_eager(make_llm, default_llm) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):", "My favourite colour is"]
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=3, ignore_eos=True)
    eager = make_llm(enforce_eager=True)
    assert eager.llm_engine.runner.native_decode is None
    assert default_llm.llm_engine.runner.native_decode is not None
    want = eager.generate(prompts, params, use_tqdm=False)
    got = default_llm.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            for tok, lp in lw.items():
                assert abs(lg[tok].logprob - lp.logprob) < 1e-4
    eager.llm_engine.check_idle()
    default_llm.llm_engine.check_idle()


def test_native_decode_declines_what_it_does_not_cover(make_llm, tmp_path) -> None:
    qwen3 = make_llm(make_tiny_hf_model(tmp_path, "qwen3"), num_kv_blocks=16, block_size=8, max_model_len=512)
    assert qwen3.llm_engine.runner.native_decode is None  # q/k RMSNorm
    torch_backend = make_llm(
        make_tiny_hf_model(tmp_path, "llama"), num_kv_blocks=16, max_model_len=512, attention_backend="torch"
    )
    assert torch_backend.llm_engine.runner.native_decode is None
    out = torch_backend.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    torch_backend.llm_engine.check_idle()
