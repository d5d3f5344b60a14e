"""The step-time budget in the engine: its option, greedy tokens it must not change, and what it does
to a running stream while long prompts arrive (the default model, in-process)."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterator

import pytest
import torch

from pagedllm.config import EngineConfig
from pagedllm.engine.engine_checks import resolve_step_time
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched.step_budget import StepBudget
from pagedllm_bench.step_time import measure


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread for every test here: with two on a machine whose other core is busy, every parallel region waits
    for the thread the OS has descheduled, and step times become the OS's, not the work's."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf])
def test_max_step_time_ms_refuses_bad_values(value):
    with pytest.raises(ValueError, match="max_step_time_ms"):
        EngineConfig(max_step_time_ms=value)


def test_the_target_by_device_task_and_pipeline():
    config = EngineConfig()
    assert resolve_step_time(config, "generate", "cpu", 1) == pytest.approx(0.5), "500 ms on CPU by default"
    assert resolve_step_time(config, "generate", "cuda", 1) is None, "off on a GPU by default"
    assert resolve_step_time(config, "embed", "cpu", 1) is None, "pooling keeps the token budget"
    assert resolve_step_time(config, "generate", "cpu", 2) is None, "interleaved pipeline steps too"
    assert resolve_step_time(EngineConfig(max_step_time_ms=0), "generate", "cpu", 1) is None, "0: off"
    assert resolve_step_time(EngineConfig(max_step_time_ms=50), "generate", "cuda", 1) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="max_step_time_ms does not apply to task 'embed'"):
        resolve_step_time(EngineConfig(max_step_time_ms=50), "embed", "cpu", 1)
    with pytest.raises(ValueError, match="max_step_time_ms does not apply with pipeline stages"):
        resolve_step_time(EngineConfig(max_step_time_ms=50), "generate", "cpu", 2)


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    """The default model with room for two 2k-token prompts beside a stream."""
    eng = LLMEngine(EngineConfig(max_model_len=4096, num_kv_blocks=600))
    yield eng
    eng.shutdown()


def run_greedy(
    engine: LLMEngine, target_s: float | None, prompts: list[list[int]]
) -> tuple[list[list[int]], int]:
    """Greedy tokens of ``prompts`` under the step-time target ``target_s`` (None: the token budget
    alone), and the steps taken. The last prompt comes first and decodes while the others arrive
    together, so that their prefill is chunked beside a decode."""
    engine.scheduler.step_budget = (
        None if target_s is None else StepBudget(target_s, engine.config.block_size)
    )
    engine.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = engine.step_events.num_steps
    engine.add_request(str(len(prompts) - 1), prompts[-1], params)
    engine.step()
    for i, prompt in enumerate(prompts[:-1]):
        engine.add_request(str(i), prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    engine.check_idle()
    return [done[str(i)] for i in range(len(prompts))], engine.step_events.num_steps - first


def test_greedy_tokens_are_the_same_with_and_without_the_budget(engine):
    """Chunked prefill beside decodes must not change greedy tokens: a 1 ms target cuts the prompts
    into one-block chunks, a 40 ms one into chunks the cost model sizes."""
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (600, 233, 47, 5)]
    try:
        base, base_steps = run_greedy(engine, None, prompts)
        assert base_steps == 13, "the token budget computes the prompts that arrive together in one step"
        for target_s in (0.001, 0.04):
            tokens, steps = run_greedy(engine, target_s, prompts)
            assert tokens == base
            assert steps > base_steps, "the prompts were chunked"
    finally:
        engine.scheduler.step_budget = StepBudget(0.2, engine.config.block_size)


def test_each_step_computes_a_block_of_a_waiting_prompt_beside_the_decodes(engine):
    """With a target no step can meet, each step still runs the stream's decode and at least one
    block of the waiting prompt, until the prompt is done: after a first chunk of four blocks (the
    budget's start while it has measured prefill at one size only, the stream's prompt), chunks of
    one block, or of the few blocks that give the prompt half of the step's predicted time."""
    block = engine.config.block_size
    engine.scheduler.step_budget = StepBudget(1e-6, block)
    rng = random.Random(3)
    try:
        stream = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        engine.add_request("stream", [rng.randrange(100, 40000) for _ in range(8)], stream)
        engine.step()
        first = engine.step_events.num_steps
        long = [rng.randrange(100, 40000) for _ in range(400)]
        engine.add_request("long", long, SamplingParams(max_tokens=1))
        while "long" in engine.output_processor.parents:
            engine.step()
        records = [dict((r, n) for r, n, _ in rec.scheduled) for rec in engine.step_events.since(first)]
        assert all(rec["stream"] == 1 for rec in records), "the decode runs every step"
        chunks = [rec["long"] for rec in records]
        assert chunks[0] == 4 * block and sum(chunks) == len(long), chunks
        assert all(n >= block and n % block == 0 for n in chunks), chunks
        # How many blocks make half a step depends on the measured costs of prompt rows and decode
        # rows (prompt rows on AMX tiles are cheap beside a decode row): the 400 tokens still take
        # several steps, never one.
        assert len(chunks) >= 3, chunks
        engine.abort_request("stream")
        engine.check_idle()
    finally:
        engine.scheduler.step_budget = StepBudget(0.2, engine.config.block_size)


@pytest.mark.slow
def test_a_streams_longest_gap_stays_near_the_target_while_long_prompts_arrive(engine):
    """Two 2,000-token prompts arrive at once beside a decoding stream. Under the token budget the
    stream waits out one step that computes both (the baseline, measured here). With a target of a
    quarter of that stall, learned from scratch by the cost model, the stream's longest gap stays
    within 1.5x the target, and the prompts' time to first token within 1.3x the baseline's."""
    rng = random.Random(11)
    try:
        engine.scheduler.step_budget = None
        fixed = [measure(engine, 1, 2, 2000, 10, rng)]
        target_s = fixed[0].max_gap / 4
        engine.scheduler.step_budget = StepBudget(target_s, engine.config.block_size)
        budgeted = measure(engine, 1, 2, 2000, 10, rng)
        engine.scheduler.step_budget = None
        fixed.append(measure(engine, 1, 2, 2000, 10, rng))  # the baseline again, after: drift shows
    finally:
        engine.scheduler.step_budget = StepBudget(0.2, engine.config.block_size)
    engine.check_idle()
    report = (
        f"target {target_s:.3f}s; token budget: longest gaps {[round(f.max_gap, 3) for f in fixed]}, "
        f"TTFTs {[[round(t, 2) for t in f.ttfts] for f in fixed]}; step budget: gaps "
        f"{[round(g, 3) for g in budgeted.gaps]}, TTFTs {[round(t, 2) for t in budgeted.ttfts]}"
    )
    assert all(f.steps == 1 for f in fixed), report  # one step computed both prompts
    assert budgeted.steps >= 4, report
    assert budgeted.max_gap <= 1.5 * target_s, report
    baseline_ttft = statistics.mean(max(f.ttfts) for f in fixed)  # the runs before and after
    assert max(budgeted.ttfts) <= 1.3 * baseline_ttft, report
