"""Mistral with a sliding window shorter than its prompts: greedy tokens equal HF transformers'
(eager attention, which applies the window) with prefix caching, chunked prefill and forced
preemption, in the torch, CPU and Triton (interpreted) attention backends; a long request holds a
bounded number of KV blocks; per-layer windows from HF configs."""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from helpers.model_factory import make_tiny_hf_model  # noqa: E402
from helpers.reference import assert_greedy_close, hf_greedy  # noqa: E402
from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.model.config import ModelConfig  # noqa: E402
from pagedllm.sched.kv_cache_manager import uniform_sliding_window  # noqa: E402

TRITON = pytest.param(
    "triton",
    marks=[
        pytest.mark.slow,
        pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    ],
)
BACKENDS = ["torch", "cpu", TRITON]

WINDOW = 12
BLOCK_SIZE = 8
MAX_TOKENS = 24


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(100, 40000) for _ in range(24)]  # a prefix the cache can share
    out = [shared + [rng.randrange(100, 40000) for _ in range(n)] for n in (8, 30)]
    out += [[rng.randrange(100, 40000) for _ in range(n)] for n in (33, 47)]
    return out


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[tuple[list[int], Any]]]:
    """A tiny Mistral with a window of 12 and HF's greedy tokens and top-5 for every prompt."""
    path = make_tiny_hf_model(
        tmp_path_factory.mktemp("swa"), "mistral", initializer_range=0.2, sliding_window=WINDOW
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    refs = [hf_greedy(hf, ids, MAX_TOKENS) for ids in PROMPTS]
    # The window must matter for these prompts: without it HF generates something else.
    hf.config.sliding_window = None
    for layer in hf.model.layers:
        layer.self_attn.sliding_window = None
    assert any(hf_greedy(hf, ids, MAX_TOKENS)[0] != ref[0] for ids, ref in zip(PROMPTS, refs, strict=True))
    return path, refs


def generate_and_compare(llm: LLM, refs: list[tuple[list[int], Any]], label: str) -> list[Any]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for i, (out, (hf_tokens, hf_top)) in enumerate(zip(outs, refs, strict=True)):
        o = out.outputs[0]
        assert_greedy_close(o.token_ids, o.logprobs, hf_tokens, hf_top, f"{label} prompt {i}")
    llm.llm_engine.check_idle()
    return outs


@pytest.mark.parametrize("backend", BACKENDS)
def test_mistral_window_matches_hf(mistral: tuple[str, Any], backend: str) -> None:
    path, refs = mistral
    llm = LLM(path, attention_backend=backend, block_size=BLOCK_SIZE, num_kv_blocks=64)
    assert llm.llm_engine.runner.model.config.sliding_window == WINDOW
    generate_and_compare(llm, refs, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mistral_window_chunked_prefix_cached_preempted(mistral: tuple[str, Any], backend: str) -> None:
    path, refs = mistral
    llm = LLM(
        path,
        attention_backend=backend,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=16,  # prompts run in chunks of up to 16 tokens
        num_kv_blocks=10,  # the least a request may need without a window: too few for four at once
        enable_prefix_caching=True,
    )
    generate_and_compare(llm, refs, f"{backend} first pass")
    assert llm.llm_engine.get_stats().num_preemptions > 0
    # The second pass hits the prefix cache.
    outs = generate_and_compare(llm, refs, f"{backend} second pass")
    assert any(o.num_cached_tokens > 0 for o in outs)


LONG_WINDOW = 16
LONG_PROMPT = 120
LONG_OUTPUT = 100
LONG_BUDGET = 32


@pytest.fixture(scope="module")
def long_mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[int], list[int], Any]:
    path = make_tiny_hf_model(
        tmp_path_factory.mktemp("swa-long"), "mistral", initializer_range=0.2, sliding_window=LONG_WINDOW
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    rng = random.Random(11)
    prompt = [rng.randrange(100, 40000) for _ in range(LONG_PROMPT)]
    tokens, top = hf_greedy(hf, prompt, LONG_OUTPUT)
    return path, prompt, tokens, top


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_long_request_holds_a_bounded_number_of_blocks(long_mistral: Any, backend: str) -> None:
    """220 tokens with a window of 16 in blocks of 8 (28 blocks in all): at every step a request holds
    at most the blocks its window and the step's tokens touch, and its output still matches HF."""
    path, prompt, hf_tokens, hf_top = long_mistral
    llm = LLM(
        path,
        attention_backend=backend,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=LONG_BUDGET,
        num_kv_blocks=64,
        enable_prefix_caching=True,
    )
    engine = llm.llm_engine
    manager = engine.kv_cache_manager
    assert manager.sliding_window == LONG_WINDOW
    params = SamplingParams(temperature=0, max_tokens=LONG_OUTPUT, logprobs=5, ignore_eos=True)
    prefill_bound = -(-(LONG_WINDOW - 1 + LONG_BUDGET) // BLOCK_SIZE) + 1
    decode_bound = -(-LONG_WINDOW // BLOCK_SIZE) + 1
    for attempt in range(2):  # the second pass hits blocks the first released to the cache
        engine.add_request(f"long-{attempt}", prompt, params)
        final = None
        most_held = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final = out
            for req in engine.scheduler.running:
                held = manager.num_held_blocks(req)
                most_held = max(most_held, held)
                assert held <= prefill_bound, (held, req.num_computed_tokens)
                if req.num_output_tokens >= 2:
                    assert held <= decode_bound, (held, req.num_computed_tokens)
                assert engine.kv_cache_manager.num_free_blocks == 64 - held
        assert final is not None
        o = final.outputs[0]
        assert_greedy_close(o.token_ids, o.logprobs, hf_tokens, hf_top, f"{backend} pass {attempt}")
        assert len(o.token_ids) == LONG_OUTPUT and most_held <= prefill_bound
        if attempt == 1:
            assert final.num_cached_tokens > 0
        engine.check_idle()


def _hf_config(**overrides: Any) -> dict[str, Any]:
    config = {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    config.update(overrides)
    return config


def test_config_layer_windows() -> None:
    mistral = ModelConfig.from_hf_config(_hf_config(sliding_window=4096))
    assert [mistral.layer_sliding_window(i) for i in range(4)] == [4096] * 4
    assert uniform_sliding_window(mistral) == 4096
    assert ModelConfig.from_hf_config(_hf_config()).layer_sliding_window(0) is None
    mixed = ModelConfig.from_hf_config(
        _hf_config(
            sliding_window=32,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        )
    )
    assert [mixed.layer_sliding_window(i) for i in range(4)] == [32, None, 32, None]
    assert uniform_sliding_window(mixed) is None  # full layers need every block
    # All full: the same config as one without layer_types.
    full = ModelConfig.from_hf_config(_hf_config(layer_types=["full_attention"] * 4))
    assert full == ModelConfig.from_hf_config(_hf_config()) and uniform_sliding_window(full) is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"sliding_window": 8, "layer_types": ["sliding_attention"] * 3}, "3 entries for 4 layers"),
        ({"sliding_window": 8, "layer_types": ["chunked_attention"] * 4}, "Unsupported layer_types"),
        ({"layer_types": ["sliding_attention"] * 4}, "no sliding_window"),
    ],
)
def test_config_rejects_bad_layer_types(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(_hf_config(**overrides))
