"""The step-time budget: its cost model, its chunk limits, and the scheduler under it (no model)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched.kv_cache_manager import KVCacheManager
from pagedllm.sched.scheduler import Scheduler, SchedulerConfig
from pagedllm.sched.step_budget import (
    MAX_SAMPLES,
    MAX_STRETCH,
    MIN_PREFILL_SHARE,
    SAMPLES_PER_KIND,
    StepBudget,
    StepCostModel,
    StepShape,
)

# A machine's step time: 4 ms per step, 0.5 ms per token, 0.3 ms per row, 20 ns per attention pair,
# 10 ms per prefill chunk and 10 us per cached token it reads.
TRUE = (0.004, 0.0005, 0.0003, 2e-8, 0.01, 1e-5)


def true_time(shape: StepShape) -> float:
    return sum(c * f for c, f in zip(TRUE, shape.features(), strict=True))


def noisy_steps(seed: int, count: int, slow_share: float) -> list[tuple[StepShape, float]]:
    """Decode steps of 1-8 rows, two in five with a prefill chunk, their times off by +-10%, and a
    share of them slowed 2-10x (another process took the cores)."""
    rng = random.Random(seed)
    steps = []
    for _ in range(count):
        shape = StepShape()
        for _ in range(rng.randrange(1, 9)):
            shape = shape.plus(rng.randrange(10, 4000), 1)
        if rng.random() < 0.4:
            shape = shape.plus(rng.randrange(0, 6000), rng.choice([16, 48, 128, 256, 512, 1024]))
        seconds = true_time(shape) * rng.uniform(0.9, 1.1)
        if rng.random() < slow_share:
            seconds *= rng.uniform(2, 10)
        steps.append((shape, seconds))
    return steps


def test_shape_counts_rows_tokens_pairs_and_prefill():
    shape = StepShape().plus(100, 1).plus(0, 64).plus(10, 3, num_drafts=2)
    assert (shape.rows, shape.tokens, shape.prefill_rows, shape.prefill_tokens) == (3, 68, 1, 64)
    # A decode at position 100 attends 101 keys; a 64-token chunk from 0, 1 + ... + 64.
    assert shape.pairs == 101 + 64 * 65 / 2 + (3 * 10 + 6)
    assert StepShape().plus(100, 1) + StepShape().plus(0, 64) == StepShape().plus(100, 1).plus(0, 64)
    assert shape.overhead() == StepShape().plus(100, 1).plus(0, 0, prefill=True).plus(10, 3, num_drafts=2)
    deep = StepShape().plus(500, 64)
    assert (deep.prefill_context, deep.overhead().prefill_context, deep.overhead().tokens) == (500, 500, 0)


@pytest.mark.parametrize("slow_share", [0.0, 0.3])
def test_cost_model_recovers_the_machine_despite_slow_steps(slow_share):
    model = StepCostModel()
    for shape, seconds in noisy_steps(0, 300, slow_share):
        model.observe(shape, seconds)
    for shape, _ in noisy_steps(1, 50, 0.0):
        predicted = model.predict(shape)
        assert predicted is not None
        assert abs(predicted - true_time(shape)) <= 0.2 * true_time(shape)
    coef = model.coefficients
    assert coef is not None and min(coef) >= 0


def test_cost_model_waits_for_two_prefill_sizes_and_ignores_non_measurements():
    model = StepCostModel()
    decode = StepShape().plus(10, 1)
    for _ in range(10):
        model.observe(decode, 0.01)
    model.observe(decode.plus(0, 64), 0.05)
    model.observe(decode.plus(64, 64), 0.06)
    assert model.predict(decode) is None, "one prefill size does not determine the prefill cost"
    model.observe(decode, float("nan"))
    model.observe(decode, 0.0)
    model.observe(StepShape(), 1.0)
    assert model.num_samples == 2 + SAMPLES_PER_KIND, "two prefill steps, the latest decodes of one kind"
    model.observe(decode.plus(0, 256), 0.15)
    assert model.predict(decode.plus(0, 128)) is not None


def test_cost_model_keeps_every_kind_of_step():
    """A long run of small chunks deep into a prompt does not push out the decodes and the early,
    larger chunks: the fit still tells the cost per token from the cost per chunk."""
    model = StepCostModel()
    decode = StepShape().plus(10, 1)
    for i in range(20):
        model.observe(decode.plus(0, 64 << (i % 4)), true_time(decode.plus(0, 64 << (i % 4))))
        model.observe(decode, true_time(decode))
    for start in range(4096, 8192, 32):
        model.observe(decode.plus(start, 32), true_time(decode.plus(start, 32)))
    assert model.num_samples <= MAX_SAMPLES
    for shape in (
        decode,
        decode.plus(0, 512),
        decode.plus(6000, 32),
        decode.plus(6000, 256),
        decode.plus(6000, 0, prefill=True),
    ):
        predicted = model.predict(shape)
        assert predicted is not None and abs(predicted - true_time(shape)) <= 0.05 * true_time(shape)


def trained_budget(target_s: float, block_size: int = 16) -> StepBudget:
    budget = StepBudget(target_s, block_size)
    for shape, seconds in noisy_steps(2, 200, 0.1):
        budget.observe(shape, seconds)
    budget.largest_prefill = 10**6  # no ramp: the fit alone decides
    return budget


@settings(max_examples=200, deadline=None)
@given(
    target_ms=st.floats(1, 2000),
    decodes=st.lists(st.integers(1, 8000), max_size=64),
    start=st.integers(0, 8000),
    remaining=st.integers(1, 8000),
    token_budget=st.integers(1, 8192),
    block_size=st.sampled_from([1, 4, 16, 32]),
    with_prefill=st.booleans(),
)
def test_chunk_limit_bounds(target_ms, decodes, start, remaining, token_budget, block_size, with_prefill):
    budget = trained_budget(target_ms / 1000, block_size)
    shape = StepShape()
    for position in decodes:
        shape = shape.plus(position, 1)
    if with_prefill:
        shape = shape.plus(0, 32)
    n = budget.chunk_limit(shape, start, remaining, token_budget)
    assert 0 <= n <= min(remaining, token_budget), "within the prompt and the token budget"
    if not with_prefill:
        assert n >= min(block_size, remaining, token_budget), "the step's first chunk: one block at least"
    predicted = budget.model.predict(shape.plus(start, n, prefill=True))
    limit = budget.step_limit(shape, start)
    assert predicted is not None and limit is not None and limit >= budget.target_s
    overhead = budget.model.predict(shape.plus(start, 0, prefill=True).overhead())
    stretched = min(overhead / (1 - MIN_PREFILL_SHARE), MAX_STRETCH * budget.target_s)
    assert limit == max(budget.target_s, stretched)
    if n > min(block_size, remaining, token_budget) or with_prefill and n:
        assert predicted <= limit, "beyond the floor, within the limit"
        if n < remaining:
            assert (start + n) % block_size == 0, "a partial chunk ends on a block boundary"
    bigger = n + block_size
    if bigger <= min(remaining, token_budget) and n >= block_size:
        assert budget.model.predict(shape.plus(start, bigger)) > limit, "the largest that fits"


def test_deeper_chunks_are_smaller():
    budget = trained_budget(0.2)
    decode = StepShape().plus(50, 1)
    sizes = [budget.chunk_limit(decode, start, 8000, 8192) for start in (0, 2000, 4000, 8000)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]


def test_budget_ramps_up_from_measurements():
    budget = StepBudget(0.2, 16)
    decode = StepShape().plus(50, 1)
    assert budget.chunk_limit(decode, 0, 8000, 4096) == 64, "four blocks before anything is measured"
    done = 0
    sizes = []
    for _ in range(6):
        n = budget.chunk_limit(decode, done, 8000, 4096)
        sizes.append(n)
        shape = decode.plus(done, n)
        budget.observe(shape, true_time(shape))
        done += n
    assert sizes[:3] == [64, 128, 256], "twice the largest prefill measured within the target"
    assert true_time(decode.plus(done, sizes[-1])) <= 0.2 * 1.1


def make_request(rid: str, prompt_len: int, max_tokens: int, rng: random.Random) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=[rng.randrange(1, 50) for _ in range(prompt_len)],
        params=SamplingParams(max_tokens=max_tokens, temperature=0),
        max_tokens=max_tokens,
        eos_token_ids=[0],
    )


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    target_ms=st.sampled_from([1.0, 20.0, 100.0, 400.0]),
    block_size=st.sampled_from([4, 16]),
    token_budget=st.integers(8, 2048),
    policy=st.sampled_from(["fcfs", "priority"]),
)
def test_scheduler_under_a_step_budget(seed, target_ms, block_size, token_budget, policy):
    """Random arrivals of short and long prompts, steps timed by a known machine: every running
    decode is scheduled before any prefill (FCFS), the first prefill chunk gets one block at least,
    beyond it chunks of a step with decodes keep its predicted time within its limit, and every
    request finishes."""
    rng = random.Random(seed)
    manager = KVCacheManager(400, block_size, True)
    config = SchedulerConfig(8, token_budget, policy=policy, max_step_time_s=target_ms / 1000)
    sched = Scheduler(config, manager)
    assert sched.step_budget is not None
    next_id = 0
    for _ in range(3000):
        if next_id < 12 and rng.random() < 0.2:
            long = rng.random() < 0.3
            req = make_request(
                f"r{next_id}", rng.randrange(200, 700) if long else rng.randrange(1, 40), 8, rng
            )
            req.priority = rng.randrange(3) if policy == "priority" else 0
            sched.add_request(req)
            next_id += 1
        if not sched.has_unfinished_requests():
            if next_id >= 12:
                break
            continue
        decoding = [r for r in sched.running if r.num_tokens_with_pending - r.num_computed_tokens == 1]
        probes = sched.step_budget.probes
        out = sched.schedule()
        probed = sched.step_budget.probes > probes  # a step that probes a larger chunk may go past
        assert out.num_batched_tokens <= token_budget
        rows = out.scheduled_requests
        decodes = [s.request in decoding for s in rows]
        if policy == "fcfs":
            assert decodes == sorted(decodes, reverse=True), "decode rows come before prefill chunks"
        scheduled = {s.request.request_id for s in rows}
        if policy == "fcfs" and not out.preempted:  # (priority: more urgent prompts come first)
            for r in decoding[:token_budget]:
                assert r.request_id in scheduled or r.status != RequestStatus.RUNNING, "decodes always run"
        chunks = [s for s in rows if s.num_tokens > 1]
        if chunks:
            first = chunks[0]
            left = first.request.num_tokens - first.request.num_computed_tokens
            room = token_budget - sum(s.num_tokens for s in rows[: rows.index(first)])
            assert first.num_tokens >= min(block_size, left, room), "a waiting prompt progresses"
            streams = any(s.request in decoding for s in rows)  # (a step of prompts alone is not bounded)
            if streams and not probed and (len(chunks) > 1 or first.num_tokens > block_size):
                predicted = sched.step_budget.model.predict(out.shape)
                if predicted is not None:
                    spent = sched.step_budget.model.predict(out.shape.overhead())
                    assert spent is not None
                    target_s = target_ms / 1000
                    most = max(target_s, min(spent / (1 - MIN_PREFILL_SHARE), MAX_STRETCH * target_s))
                    assert predicted <= most * 1.0001, "within the step's limit"
        sampled = [s.request for s in rows if s.needs_sample]
        sched.update_after_step(out)
        sched.step_budget.observe(out.shape, true_time(out.shape) * rng.uniform(0.9, 1.1))
        for req in sampled:
            req.append_output_token(rng.randrange(1, 50))
            if req.num_output_tokens >= req.max_tokens:
                sched.finish_request(req, RequestStatus.FINISHED_STOPPED)
    assert not sched.has_unfinished_requests(), "every request finishes"
    manager.check_idle()


def test_scheduler_config_refuses_a_target_where_it_cannot_apply():
    with pytest.raises(ValueError, match="max_step_time_s"):
        SchedulerConfig(4, 64, whole_prompts=True, max_step_time_s=0.1)
    with pytest.raises(ValueError, match="max_step_time_s"):
        SchedulerConfig(4, 64, interleaved_steps=2, max_step_time_s=0.1)
    with pytest.raises(ValueError, match="target"):
        StepBudget(0.0, 16)
