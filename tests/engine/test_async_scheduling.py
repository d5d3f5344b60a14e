"""Scheduling ahead (``async_scheduling``): step k + 1 is scheduled and launched before step k's tokens
reach the host. It must not change any output: the same tokens, text, finish and stop reasons and
log probabilities as the engine that resolves every step before scheduling the next, with stop
strings, EOS, stop token ids, max_tokens, n > 1, seeded sampling, penalties and bad words (which
make the engine wait for the host), chunked prefill, preemption while a step is in flight, prefix
caching and aborts. Every test checks that the KV pool is idle again afterwards."""

from __future__ import annotations

from typing import Any

import pytest

from helpers.prompts import PROMPTS
from pagedllm import SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.outputs import RequestOutput

# Mixed stop conditions: every way a sequence can end, some found only at resolution.
PARAMS = [
    SamplingParams(temperature=0, max_tokens=40, logprobs=3),  # EOS may end it
    SamplingParams(temperature=0, max_tokens=30, stop=[".", "\n"]),  # stop strings
    SamplingParams(temperature=0, max_tokens=25, stop=[" the"], include_stop_str_in_output=True),
    SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),  # length, known ahead
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, n=2),  # seeded siblings
    SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3),  # waits for the host
    SamplingParams(temperature=0, max_tokens=20, min_tokens=6, stop=["."]),  # waits until 6 tokens
    SamplingParams(temperature=0, max_tokens=20, bad_words=["the"]),  # waits for the host
    SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=18, logprobs=2, ignore_eos=True),
]


def workload() -> tuple[list[str], list[SamplingParams]]:
    prompts = PROMPTS[: 2 * len(PARAMS)]
    return prompts, [PARAMS[i % len(PARAMS)] for i in range(len(prompts))]


def ahead_indices() -> list[int]:
    """The requests of :func:`workload` that never make the engine wait for the host."""
    return [
        i
        for i, p in enumerate(workload()[1])
        if p.repetition_penalty == 1.0 and not p.min_tokens and not p.bad_words
    ]


def assert_same(actual: list[RequestOutput], expected: list[RequestOutput]) -> None:
    """Same tokens, text, finish and stop reasons; log probabilities within float noise."""
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert len(a.outputs) == len(e.outputs), f"request {i}"
        for ca, ce in zip(a.outputs, e.outputs, strict=True):
            label = f"request {i} sequence {ca.index}"
            assert (ca.index, ca.token_ids, ca.text) == (ce.index, ce.token_ids, ce.text), label
            assert (ca.finish_reason, ca.stop_reason) == (ce.finish_reason, ce.stop_reason), label
            assert (ca.logprobs is None) == (ce.logprobs is None), label
            for step_a, step_e in zip(ca.logprobs or [], ce.logprobs or [], strict=True):
                assert step_a.keys() == step_e.keys(), label
                for t in step_a:
                    assert abs(step_a[t].logprob - step_e[t].logprob) < 1e-3, label
                    assert step_a[t].rank == step_e[t].rank, label


def generate(llm: Any, prompts: list[str], params: list[SamplingParams]) -> list[RequestOutput]:
    outs: list[RequestOutput] = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.check_idle()
    return outs


class LaunchSpy:
    """Counts launched steps and those that decode a token still pending on the device."""

    def __init__(self, engine: LLMEngine) -> None:
        self.launches = 0
        self.ahead = 0
        runner = engine.runner
        launch = runner.launch

        def spy(scheduler_output: Any, times: Any = None) -> Any:
            self.launches += 1
            self.ahead += any(
                scheduled.request.num_pending_tokens for scheduled in scheduler_output.scheduled_requests
            )
            return launch(scheduler_output, times)

        runner.launch = spy  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def sync_outputs(default_llm: Any) -> list[RequestOutput]:
    assert not default_llm.llm_engine.async_scheduling, "scheduling ahead is off on the CPU by default"
    default_llm.llm_engine.reset_prefix_cache()
    return generate(default_llm, *workload())


@pytest.fixture(scope="module")
def async_llm(make_llm: Any) -> Any:
    llm = make_llm(async_scheduling=True)
    assert llm.llm_engine.async_scheduling
    return llm


@pytest.mark.slow
def test_outputs_match_the_synchronous_engine(async_llm: Any, sync_outputs: list[RequestOutput]) -> None:
    spy = LaunchSpy(async_llm.llm_engine)
    outs = generate(async_llm, *workload())
    assert_same(outs, sync_outputs)
    # It ran ahead once the requests that wait for the host had finished.
    assert spy.ahead >= 10, (spy.ahead, spy.launches)
    # Tokens computed for sequences that had already ended are dropped, not counted.
    expected_tokens = sum(len(c.token_ids) for o in sync_outputs for c in o.outputs)
    engine = async_llm.llm_engine
    before = engine.num_generation_tokens
    generate(async_llm, *workload())
    assert engine.num_generation_tokens - before == expected_tokens


@pytest.mark.slow
def test_every_step_after_the_prefill_runs_ahead(async_llm: Any, sync_outputs: list[RequestOutput]) -> None:
    prompts, params = workload()
    picked = ahead_indices()
    spy = LaunchSpy(async_llm.llm_engine)
    outs = generate(async_llm, [prompts[i] for i in picked], [params[i] for i in picked])
    assert spy.ahead == spy.launches - 1, (spy.ahead, spy.launches)  # all but the one prefill step
    assert_same(outs, [sync_outputs[i] for i in picked])


@pytest.mark.slow
def test_chunked_prefill_and_preemption_in_flight(make_llm: Any) -> None:
    """A small token budget chunks prefills; a tiny pool preempts requests whose token is in flight.

    Float weights: a preempted request's recomputed K/V come from the prefill attention kernel rather
    than the decode one, which differ in the last bits; int8-quantized activations would turn those
    into visible differences in the sampled sequences this compares."""
    float_sync = generate(make_llm(quantization="none"), *workload())
    llm = make_llm(
        async_scheduling=True,
        max_num_batched_tokens=48,
        num_kv_blocks=16,
        enable_prefix_caching=False,
        quantization="none",
    )
    spy = LaunchSpy(llm.llm_engine)
    scheduler = llm.llm_engine.scheduler
    preempt = scheduler._preempt
    in_flight: list[str] = []

    def spy_preempt(request: Any, out: Any) -> None:
        if request.num_pending_tokens:
            in_flight.append(request.request_id)
        preempt(request, out)

    scheduler._preempt = spy_preempt  # type: ignore[method-assign]
    outs = generate(llm, *workload())
    assert llm.llm_engine.get_stats().num_preemptions > 0
    assert spy.ahead > 0
    assert_same(outs, float_sync)
    # Long outputs of requests that let the engine run ahead: the newest running request, preempted
    # when the pool runs out, has its token in flight.
    long_prompts = PROMPTS[4:10]
    long_params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=1)
    outs = generate(llm, long_prompts, long_params)
    assert in_flight, "a request was preempted while its token was in flight"
    reference = make_llm(
        async_scheduling=False,
        max_num_batched_tokens=48,
        num_kv_blocks=16,
        enable_prefix_caching=False,
        quantization="none",
    )
    assert_same(outs, generate(reference, long_prompts, long_params))


@pytest.mark.slow
def test_prefix_cache_hits_and_streaming_deltas(async_llm: Any, sync_outputs: list[RequestOutput]) -> None:
    """Second pass hits the cache; per-step outputs (what a stream sends) only ever extend the text."""
    engine = async_llm.llm_engine
    prompts, params = workload()
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"stream-{i}", prompt, p)
    texts: dict[tuple[str, int], str] = {}
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                previous = texts.get((out.request_id, c.index), "")
                assert c.text.startswith(previous), (out.request_id, previous, c.text)
                texts[(out.request_id, c.index)] = c.text
            if out.finished:
                final[out.request_id] = out
    engine.check_idle()
    outs = [final[f"stream-{i}"] for i in range(len(prompts))]
    assert any(o.num_cached_tokens >= 16 for o in outs)
    assert_same(outs, sync_outputs)


@pytest.mark.slow
def test_abort_while_a_step_is_in_flight(async_llm: Any, sync_outputs: list[RequestOutput]) -> None:
    engine = async_llm.llm_engine
    prompts, params = workload()
    ids = [f"abort-{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, p)
    final: dict[str, RequestOutput] = {}
    aborted = {ids[0], ids[3]}
    for _ in range(4):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert engine._in_flight and any(
        engine.scheduler.requests.get(rid) is not None and engine.scheduler.requests[rid].num_pending_tokens
        for rid in aborted
    ), "an aborted request has a token in flight"
    engine.abort_request(list(aborted))
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in aborted
            if out.finished:
                final[out.request_id] = out
    engine.check_idle()
    kept = [i for i, rid in enumerate(ids) if rid not in aborted]
    assert_same([final[ids[i]] for i in kept], [sync_outputs[i] for i in kept])


def test_cli_flag() -> None:
    import argparse

    from pagedllm.config import EngineConfig

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert EngineConfig.from_cli_args(parser.parse_args([])).async_scheduling is None
    assert EngineConfig.from_cli_args(parser.parse_args(["--async-scheduling"])).async_scheduling is True
    assert EngineConfig.from_cli_args(parser.parse_args(["--no-async-scheduling"])).async_scheduling is False


@pytest.mark.slow
def test_idle_after_the_last_request_stops_or_is_aborted(async_llm: Any) -> None:
    """The step launched for a request that then stops on a string (or is aborted) is not left in
    flight: the engine is idle, with every block free, once no request is left."""
    engine = async_llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=30, stop=["."])
    out = generate(async_llm, ["Roses are red,"], params)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "." and len(out.token_ids) < 30
    engine.add_request("gone", "Roses are red,", SamplingParams(temperature=0, max_tokens=30))
    for _ in range(3):
        engine.step()
    assert engine._in_flight
    engine.abort_request("gone")
    engine.check_idle()
    assert not engine.has_unfinished_requests() and engine.step() == []
