"""A model split over tensor- and pipeline-parallel ranks (CPU, gloo) generates what it generates on one
rank: the same greedy tokens, top logprobs within 1e-4 (float32), the same prompt logprobs, and the
same scheduling (preemptions, prefix-cache hits) under a small KV pool with chunked prefill and
prefix caching on (with pipeline stages, which run different steps at once, the steps come in
another order: there, preemptions and prefix hits happen too). Afterwards every KV block is free
and, once the ``LLM`` is shut down, no rank process is left.

Each case starts one engine (its ranks are processes that import torch: a few seconds each) and
checks everything on it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import pytest
from safetensors import safe_open

from helpers.prompts import PROMPTS
from pagedllm import LLM, SamplingParams
from pagedllm.engine.observe.stats import EngineStats
from pagedllm.outputs import Logprob, RequestOutput

LOGPROB_TOL = 1e-4
# A KV pool of 12 blocks of 16 tokens for 7 requests of ~50-75 tokens: requests are preempted.
# Prefill is chunked into 32-token steps, so later requests find the shared system prompt cached.
ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "block_size": 16,
    "num_kv_blocks": 12,
    "max_model_len": 256,
    "max_num_batched_tokens": 32,
    "enable_prefix_caching": True,
}
# Four prompts share a ~40-token system prompt (two full blocks); three are distinct.
WORKLOAD = PROMPTS[:7]
GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=5, ignore_eos=True)
# One request also asks for its prompt's logprobs (logits of every prompt position, gathered).
WITH_PROMPT_LOGPROBS = 4
PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    if i == WITH_PROMPT_LOGPROBS
    else GREEDY
    for i in range(len(WORKLOAD))
]


def generate(llm: LLM) -> tuple[list[RequestOutput], EngineStats]:
    outs = llm.generate(WORKLOAD, PARAMS, use_tqdm=False)
    llm.llm_engine.check_idle()
    return outs, llm.llm_engine.get_stats()


_references: dict[str, tuple[list[RequestOutput], EngineStats]] = {}


def reference(key: str, model: str | None, **extra: Any) -> tuple[list[RequestOutput], EngineStats]:
    """The one-rank outputs and stats of the workload (computed once per model)."""
    if key not in _references:
        llm = LLM(model, **ENGINE_ARGS, **extra)
        _references[key] = generate(llm)
        llm.shutdown()
    return _references[key]


def assert_top_close(ref: dict[int, Logprob], got: dict[int, Logprob], label: str) -> None:
    """The same top logprobs within the tolerance; a token may be missing from one side only where
    it ties (within the tolerance) with the other side's smallest entry."""
    smallest = min(lp.logprob for lp in got.values())
    for token, lp in ref.items():
        if token in got:
            assert abs(got[token].logprob - lp.logprob) < LOGPROB_TOL, (label, token, lp, got[token])
        else:
            assert abs(lp.logprob - smallest) < LOGPROB_TOL, (label, token, lp, got)


def assert_same_outputs(ref: list[RequestOutput], got: list[RequestOutput], label: str) -> None:
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        rc, gc = r.outputs[0], g.outputs[0]
        assert gc.token_ids == rc.token_ids, (
            f"{label} prompt {i}: tokens differ\n{rc.token_ids}\n{gc.token_ids}"
        )
        assert rc.logprobs is not None and gc.logprobs is not None
        assert len(gc.logprobs) == len(rc.logprobs) == len(rc.token_ids)
        for pos, (rt, gt) in enumerate(zip(rc.logprobs, gc.logprobs, strict=True)):
            assert_top_close(rt, gt, f"{label} prompt {i} token {pos}")
        if i == WITH_PROMPT_LOGPROBS:
            assert r.prompt_logprobs is not None and g.prompt_logprobs is not None
            assert len(g.prompt_logprobs) == len(r.prompt_logprobs) == len(r.prompt_token_ids)
            assert r.prompt_logprobs[0] is None and g.prompt_logprobs[0] is None
            for pos in range(1, len(r.prompt_logprobs)):
                rp, gp = r.prompt_logprobs[pos], g.prompt_logprobs[pos]
                assert rp is not None and gp is not None
                assert_top_close(rp, gp, f"{label} prompt {i} prompt position {pos}")
        else:
            assert g.prompt_logprobs is None


def assert_same_schedule(ref: EngineStats, got: EngineStats) -> None:
    """The workload did what it is for (preemptions, prefix hits) and the parallel engine scheduled
    exactly as the one-rank engine did (the same KV pool, the same tokens)."""
    assert ref.num_preemptions > 0, "the KV pool is too large to force preemption"
    assert ref.prefix_cache_hits > 0, "no prefix-cache hit"
    fields = [
        "num_kv_blocks",
        "num_preemptions",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "prompt_tokens",
        "prompt_tokens_computed",
        "generation_tokens",
    ]
    assert {f: getattr(got, f) for f in fields} == {f: getattr(ref, f) for f in fields}
    assert got.num_free_blocks == got.num_kv_blocks and got.num_running == got.num_waiting == 0


def run_parallel_case(model: str | None, ref_key: str, tp: int, pp: int, procs: Any, **extra: Any) -> LLM:
    """Start the engine on ``tp`` x ``pp`` ranks, compare it with one rank, check its rank processes;
    returns the (not yet shut down) ``LLM``."""
    ref_outs, ref_stats = reference(ref_key, model, **extra)
    llm = LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE_ARGS, **extra)
    try:
        # Ranks 1 .. tp*pp-1 are processes of this one.
        assert len(procs.ranks()) == tp * pp - 1, procs.describe(procs.new())
        outs, stats = generate(llm)
        label = f"TP {tp} x PP {pp}"
        assert_same_outputs(ref_outs, outs, label)
        if pp == 1:
            assert_same_schedule(ref_stats, stats)
        else:  # stages run different steps (two groups of requests): another order of steps
            assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
            assert stats.num_free_blocks == stats.num_kv_blocks
    except BaseException:
        llm.shutdown()
        raise
    return llm


def shut_down(llm: LLM, procs: Any) -> None:
    llm.shutdown()
    procs.assert_none_left()
    llm.shutdown()  # a second shutdown does nothing


def checkpoint_bytes(path: str) -> int:
    """Bytes of the float32 checkpoint's tensors."""
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return sum(4 * math.prod(f.get_slice(name).get_shape()) for name in f.keys())


CASES = [
    # (tiny model, TP, PP)
    ("llama", 1, 2),
    ("llama", 2, 2),
    ("llama6", 3, 1),
    ("qwen2", 2, 1),
    ("qwen3", 2, 1),
    ("llama_tied", 2, 2),
    pytest.param("llama", 4, 1, marks=pytest.mark.slow, id="llama-4-1"),
]


def test_tensor_parallel_2_holds_half_the_weights(tiny_model: Callable[[str], str], procs: Any) -> None:
    """TP 2 equals one rank, and the driver holds about half of the weights (its shard only)."""
    path = tiny_model("llama")
    llm = run_parallel_case(path, "llama", 2, 1, procs)
    held = llm.llm_engine.executor.resident_weight_bytes()  # type: ignore[union-attr]
    whole = checkpoint_bytes(path)
    assert 0.4 * whole < held < 0.6 * whole, (held, whole)
    shut_down(llm, procs)


@pytest.mark.parametrize("name,tp,pp", CASES)
def test_parallel_equals_one_rank(
    name: str, tp: int, pp: int, tiny_model: Callable[[str], str], procs: Any
) -> None:
    llm = run_parallel_case(tiny_model(name), name, tp, pp, procs)
    shut_down(llm, procs)


@pytest.mark.slow
def test_default_model_tensor_parallel_3(procs: Any) -> None:
    """The default model (9 query / 3 KV heads, 30 layers), dequantized to float32, on 3 ranks."""
    extra = {"quantization": "none"}
    llm = run_parallel_case(None, "default", 3, 1, procs, **extra)
    shut_down(llm, procs)
