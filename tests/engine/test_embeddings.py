"""Decoder embeddings (task embed on the default SmolLM2 model, float weights): last-token and mean
pooling against HF transformers' LlamaModel, the paged KV cache freed after every step, prefix
caching for last-token pooling, and the scheduler's whole-prompt rule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from helpers.prompts import REFERENCE_PROMPTS
from pagedllm import LLM, PoolingParams, SamplingParams


@pytest.fixture(scope="module")
def embed_llm(make_llm: Callable[..., Any]) -> LLM:
    return make_llm(task="embed", quantization="none", num_kv_blocks=64, max_model_len=512)


@torch.inference_mode()
def hf_hidden(hf_default: tuple[Any, Any], ids: list[int]) -> torch.Tensor:
    """The final (normed) hidden states of HF's LlamaModel for one prompt: ``[len(ids), hidden]``."""
    model = hf_default[0].model
    return model(torch.tensor([ids])).last_hidden_state[0].float()


def test_last_token_pooling_matches_hf(embed_llm: LLM, hf_default: tuple[Any, Any]) -> None:
    engine = embed_llm.llm_engine
    assert engine.task == "embed" and engine.pooling_config.pooling_type == "last"
    outputs = embed_llm.embed(REFERENCE_PROMPTS, use_tqdm=False)
    for out in outputs:
        expected = F.normalize(hf_hidden(hf_default, out.prompt_token_ids)[-1], dim=0)
        got = torch.tensor(out.embedding)
        assert len(got) == 576 and abs(float(got.norm()) - 1) < 1e-5
        assert float(F.cosine_similarity(got, expected, dim=0)) >= 0.9999, out.prompt
    engine.check_idle()  # every KV block is free again after its step


def test_prefix_cache_and_batch_do_not_change_the_embedding(embed_llm: LLM) -> None:
    engine = embed_llm.llm_engine
    prompt = REFERENCE_PROMPTS[2] * 4  # several full blocks
    first = torch.tensor(embed_llm.embed(prompt, use_tqdm=False)[0].embedding)
    hits = engine.kv_cache_manager.stats.hits
    again = embed_llm.embed([*REFERENCE_PROMPTS, prompt], use_tqdm=False)[-1]
    assert engine.kv_cache_manager.stats.hits > hits  # the second run reused the cached prefix
    assert float((torch.tensor(again.embedding) - first).abs().max()) < 1e-5
    engine.check_idle()


def test_wrong_parameters_are_refused(embed_llm: LLM) -> None:
    engine = embed_llm.llm_engine
    with pytest.raises(ValueError, match="task 'embed'"):
        engine.add_request("x", "Hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="dimensions"):
        embed_llm.embed("Hello", PoolingParams(dimensions=64), use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length is 512"):
        embed_llm.embed([1] * 513, use_tqdm=False)
    with pytest.raises(ValueError, match="step_pooling"):
        engine.step()
    engine.check_idle()


def test_mean_pooling_on_a_decoder(make_llm: Callable[..., Any], hf_default: tuple[Any, Any]) -> None:
    llm = make_llm(
        task="embed", quantization="none", num_kv_blocks=64, max_model_len=512, pooling_type="mean"
    )
    engine = llm.llm_engine
    assert not engine.kv_cache_manager.enable_caching  # every row is needed, none may come from the cache
    outputs = llm.embed(REFERENCE_PROMPTS[:4], use_tqdm=False)
    for out in outputs:
        expected = F.normalize(hf_hidden(hf_default, out.prompt_token_ids).mean(0), dim=0)
        assert float(F.cosine_similarity(torch.tensor(out.embedding), expected, dim=0)) >= 0.9999
    engine.check_idle()
