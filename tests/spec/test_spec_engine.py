"""Speculative decoding (prompt lookup) in the engine: greedy tokens identical with and without it,
alone and in batches, with chunked prefill, prefix caching and preemption; sampled tokens with the
same distribution (a model with a 16-token vocabulary, chi-square); acceptance counted in the stats
and on /metrics; configurations it cannot run refused at start, naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from helpers.model_factory import make_tiny_hf_model
from helpers.spec_cases import VOCAB16, chi2_homogeneity_pvalue, generated_tokens, sampled_token_counts
from pagedllm import LLM, SamplingParams
from pagedllm.engine.observe.metrics import EngineMetrics
from pagedllm.engine.observe.stats import EngineStats
from pagedllm_bench.spec import grounded_requests

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
PROMPTS = [*grounded_requests()[::4], "Once upon a time, in a small village,", "1, 2, 3, 4, 5,"]
GREEDY = SamplingParams(temperature=0, max_tokens=48)


FLOAT = {"quantization": "none", "dtype": "float32"}
_plain: dict[str, list[list[int]]] = {}


def plain_greedy(weights: dict[str, str]) -> list[list[int]]:
    """The tokens of plain decoding, with room for every request (computed once per weights)."""
    key = str(sorted(weights.items()))
    if key not in _plain:
        llm = LLM(None, max_model_len=1024, num_kv_blocks=256, **weights)
        _plain[key] = generated_tokens(llm, GREEDY, PROMPTS)
        llm.shutdown()
    return _plain[key]


@pytest.mark.parametrize(
    "engine_args",
    [
        pytest.param({"num_kv_blocks": 256}, id="batch"),
        # 64-token prefill chunks, and a pool too small for every request at once: preemption. In
        # float32: with GGUF blocks a step's int8 kernels may round a row differently with the batch
        # size, and verifying drafts makes other batches than plain decoding does (a near-tie can
        # then flip, as it can between two batch compositions of plain decoding).
        pytest.param(
            {"num_kv_blocks": 24, "max_num_batched_tokens": 64, **FLOAT}, id="chunked-preempted-float32"
        ),
    ],
)
def test_greedy_tokens_equal_plain_decoding(engine_args: dict[str, Any]) -> None:
    weights = {k: v for k, v in engine_args.items() if k in FLOAT}
    reference = plain_greedy(weights)
    llm = LLM(None, max_model_len=1024, speculative_config=NGRAM, **engine_args)
    assert generated_tokens(llm, GREEDY, PROMPTS) == reference
    stats = llm.llm_engine.get_stats()
    assert stats.spec_accepted_tokens > 0 and stats.spec_draft_tokens >= stats.spec_accepted_tokens
    if engine_args["num_kv_blocks"] == 24:
        assert stats.num_preemptions > 0, "the pool did not force preemption"
    # One request at a time, the prefix cache warm from the batch above (where the pool kept it).
    assert generated_tokens(llm, GREEDY, PROMPTS[:3], one_by_one=True) == reference[:3]
    if engine_args["num_kv_blocks"] == 256:
        assert llm.llm_engine.get_stats().prefix_cache_hits > 0
    llm.shutdown()


def test_sampled_tokens_keep_their_distribution(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Temperature 1 over a 16-token vocabulary: drafts (frequent n-gram repeats) are verified by
    rejection sampling (about half accepted), and the token at output position 10 has the same
    distribution with and without speculation (two-sample chi-square, significance 0.001, 1,200
    seeded requests each)."""
    path = make_tiny_hf_model(tmp_path_factory.mktemp("vocab16"), "llama", **VOCAB16)
    plain, _ = sampled_token_counts(path, None)
    counts, stats = sampled_token_counts(path, NGRAM)
    assert stats.spec_draft_tokens > 800 and 300 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert chi2_homogeneity_pvalue(plain, counts) > 0.001, (plain, counts)


def test_acceptance_counters_on_metrics() -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics("m", registry)
    metrics.record_stats(EngineStats(spec_drafts=3, spec_draft_tokens=12, spec_accepted_tokens=7))
    text = generate_latest(registry).decode()
    assert 'pagedllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 3.0' in text
    assert 'pagedllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 12.0' in text
    assert 'pagedllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 7.0' in text


@pytest.mark.parametrize(
    "spec,extra,words",
    [
        ('{"method": "ngram", "num_speculative_tokens": 0}', {}, "speculative_config.num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}', {}, "lookahead"),
        ('{"model": "some/draft", "num_speculative_tokens": 2}', {}, "speculative_config.model"),
        ("not json", {}, "speculative_config"),
        (NGRAM, {"async_scheduling": True}, "async_scheduling"),
        (NGRAM, {"tensor_parallel_size": 3}, "tensor_parallel_size"),
        (NGRAM, {"task": "embed"}, "speculative_config"),
    ],
    ids=["k-zero", "unknown-key", "draft-model", "bad-json", "async", "tensor-parallel", "embed"],
)
def test_refused_configurations_name_the_field(spec: str, extra: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        LLM(None, max_model_len=256, num_kv_blocks=16, speculative_config=spec, **extra)
