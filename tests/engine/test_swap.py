"""Preemption by swapping KV blocks to the host tier, and the host tier as a second-level prefix
cache, on the default model: outputs do not change, the KV that comes back is the KV that left, and
both pools are idle afterwards."""

from __future__ import annotations

import pytest
import torch

from helpers.prompts import PROMPTS
from helpers.reference import assert_greedy_close
from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.observe.metrics import EngineMetrics
from pagedllm.request import RequestStatus
from pagedllm.sched.preemption import PreemptionCosts

GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=5, ignore_eos=True)
TINY_POOL = {"num_kv_blocks": 14, "enable_prefix_caching": False}  # forces preemption on PROMPTS
SWAP_GIB = 0.05  # 72 blocks of the default model in float32


def run(llm, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.check_idle()  # both pools: every block free (or cached and unreferenced)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.fixture(scope="module")
def baseline(default_llm):
    default_llm.llm_engine.reset_prefix_cache()
    return run(default_llm)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "ahead"), [("swap", False), ("auto", False), ("recompute", False), ("swap", True)]
)
def test_greedy_outputs_do_not_depend_on_the_preemption_mode(make_llm, baseline, mode, ahead):
    """With scheduling ahead too (a GPU's default): a victim may be swapped out while its latest
    token is in flight, and comes back once that token is on the host."""
    llm = make_llm(**TINY_POOL, swap_space=SWAP_GIB, preemption_mode=mode, async_scheduling=ahead)
    results = run(llm)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0, "the pool was small enough to force preemption"
    if mode == "recompute":
        assert stats.swapped_out == 0
    else:  # on a CPU, copying a few MiB is far quicker than recomputing: auto swaps too
        assert stats.swapped_out > 0 and stats.swapped_in == stats.swapped_out
        assert stats.swap_out_bytes >= stats.swapped_out * llm.llm_engine.executor.kv_cache_bytes // 14
    for i, ((ta, la), (tb, lb)) in enumerate(zip(results, baseline, strict=True)):
        assert_greedy_close(ta, la, tb, lb, f"{mode} prompt {i}")


def _gather(storage: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """K and V of every layer for positions 0 .. num_tokens - 1 of a block table."""
    blocks = storage[:, :, block_ids]  # [2, layers, n, block_size, heads, dim]
    flat = blocks.reshape(blocks.shape[0], blocks.shape[1], -1, *blocks.shape[4:])
    return flat[:, :, :num_tokens].clone()


def test_swapped_in_kv_is_bitwise_the_kv_swapped_out(make_llm):
    llm = make_llm(num_kv_blocks=10, enable_prefix_caching=False, swap_space=SWAP_GIB, preemption_mode="swap")
    engine = llm.llm_engine
    executor = engine.executor
    storage = executor.runner.kv_cache.storage
    copy_blocks = executor.copy_blocks
    left: dict[str, tuple[int, torch.Tensor]] = {}
    compared = []

    def checked_copy(out):
        for r in out.swapped_out:  # the device blocks the copies out read, before they run
            device_of = {h: d for d, h in out.copies_out}
            ids = [device_of[h] for h in r.host_block_ids]
            left[r.request_id] = (r.num_computed_tokens, _gather(storage, ids, r.num_computed_tokens))
        copy_blocks(out)
        for r in out.swapped_in:
            num, kv = left.pop(r.request_id)
            assert torch.equal(_gather(storage, r.block_ids, num), kv), f"{r.request_id} KV changed"
            compared.append(r.request_id)

    executor.copy_blocks = checked_copy
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[4:10]):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(compared) >= 2 and not left
    engine.check_idle()


def test_aborting_a_swapped_request_frees_its_host_blocks(make_llm):
    llm = make_llm(num_kv_blocks=8, enable_prefix_caching=False, swap_space=SWAP_GIB, preemption_mode="swap")
    engine = llm.llm_engine
    host = engine.kv_cache_manager.host
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[4:8]):
        engine.add_request(str(i), prompt, params)
    for _ in range(200):
        engine.step()
        if engine.scheduler.swapped:
            break
    victim = engine.scheduler.swapped[0]
    assert victim.status == RequestStatus.SWAPPED and victim.host_block_ids
    held = len(victim.host_block_ids)
    free_before = host.pool.num_free_blocks
    engine.abort_request(victim.request_id)
    assert victim.host_block_ids == [] and host.pool.num_free_blocks == free_before + held
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_idle()


def test_the_host_tier_keeps_evicted_prefix_blocks_and_brings_them_back(make_llm):
    """A long prompt's cached blocks are evicted from a small device pool by other prompts, kept by
    the host tier, and found there when the prompt comes again: same tokens, fewer computed."""
    llm = make_llm(num_kv_blocks=12, swap_space=SWAP_GIB)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    long_prompt = PROMPTS[0] + " Then list every step again, in order, with a short reason for each."
    first = llm.generate([long_prompt], params, use_tqdm=False)[0]
    for prompt in PROMPTS[4:12]:  # distinct prompts: they evict the long prompt's blocks
        llm.generate([prompt], params, use_tqdm=False)
    engine.check_idle()
    again = llm.generate([long_prompt], params, use_tqdm=False)[0]
    stats = engine.get_stats()
    assert stats.host_prefix_cache_hits >= 16 and again.num_cached_tokens >= 16
    assert_greedy_close(
        first.outputs[0].token_ids,
        first.outputs[0].logprobs,
        again.outputs[0].token_ids,
        again.outputs[0].logprobs,
        "host prefix hit",
    )
    engine.check_idle()


def test_auto_weighs_copy_time_against_recompute_time():
    costs = PreemptionCosts(
        block_bytes=1 << 20,
        copy_bytes_per_s=1e9,
        flops_per_token=2e8,
        attention_flops_per_pair=1e4,
        flops_per_s=1e11,
    )
    # 64 blocks out and in: 134 ms; recomputing 1024 tokens: about 2.1 s -> swap.
    assert costs.prefers_swap(64, 1024)
    slow_copies = PreemptionCosts(1 << 20, 1e7, 2e8, 1e4, 1e11)  # 13 s of copies -> recompute
    assert not slow_copies.prefers_swap(64, 1024)
    assert costs.recompute_s(100) == pytest.approx((100 * 2e8 + 5050 * 1e4) / 1e11)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"preemption_mode": "later"}, "preemption_mode"),
        ({"preemption_mode": "swap"}, "swap_space"),
        ({"swap_space": -1.0}, "swap_space"),
        ({"swap_space": 1.0, "tensor_parallel_size": 2}, "swap_space"),
    ],
)
def test_bad_swap_options_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_swap_metrics_are_exported():
    from pagedllm.engine.observe.stats import EngineStats

    metrics = EngineMetrics("m")
    metrics.record_stats(
        EngineStats(
            num_swapped=2, num_host_blocks=10, num_free_host_blocks=6, swapped_out=3, swap_out_bytes=4096
        )
    )
    text = metrics.render().decode()
    assert 'pagedllm:num_requests_swapped{engine="0",model_name="m"} 2.0' in text
    assert 'pagedllm:host_kv_cache_usage_perc{engine="0",model_name="m"} 0.4' in text
    assert 'pagedllm:num_swapped_out_total{engine="0",model_name="m"} 3.0' in text
    assert 'pagedllm:swap_out_bytes_total{engine="0",model_name="m"} 4096.0' in text


def test_the_step_record_and_the_snapshot_show_swaps(make_llm):
    """What the dashboard draws: steps that swapped requests out and in, and swapped requests with
    their host blocks in a snapshot taken while they are out."""
    from pagedllm.engine.observe.engine_state import build_state

    llm = make_llm(num_kv_blocks=8, enable_prefix_caching=False, swap_space=SWAP_GIB, preemption_mode="swap")
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[4:8]):
        engine.add_request(str(i), prompt, params)
    seen_swapped = []
    while engine.has_unfinished_requests():
        engine.step()
        if engine.scheduler.swapped and not seen_swapped:
            state = build_state(engine)
            seen_swapped = state["swapped"]
            assert state["config"]["num_host_blocks"] == engine.kv_cache_manager.host.pool.num_blocks
    assert seen_swapped and all(row["state"] == "swapped" and row["host_block_ids"] for row in seen_swapped)
    records = engine.step_events.since(0)
    out_ids = {rid for r in records for rid in r.swapped_out}
    in_ids = {rid for r in records for rid in r.swapped_in}
    assert out_ids and out_ids == in_ids and out_ids <= {rid for r in records for rid in r.preempted}
    # Between leaving and coming back, a request is listed as swapped in every step's record.
    for rid in out_ids:
        left = next(r.step for r in records if rid in r.swapped_out)
        back = next(r.step for r in records if rid in r.swapped_in)
        assert all(rid in r.swapped for r in records if left <= r.step < back)
    engine.check_idle()
