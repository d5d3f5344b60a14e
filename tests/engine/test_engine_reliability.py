"""No request may stop, hang or starve the engine: rows with no token left, colliding ids, unbounded
n, slow grammars, long prompt logprobs. Every test ends with the engine idle and all blocks free."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Any

import pytest
import torch

from pagedllm import SamplingParams, StructuredOutputsParams
from pagedllm.engine.async_engine import AsyncLLMEngine, QueueFullError
from pagedllm.sample import Sampler, SamplingInputs
from pagedllm.sample.sampler import NO_TOKEN


def _inputs(params: list[SamplingParams], masked_rows: list[int] | None = None) -> SamplingInputs:
    n = len(params)
    return SamplingInputs(
        params=params,
        prompt_token_ids=[[1]] * n,
        output_token_ids=[[]] * n,
        generators=[None] * n,
        eos_token_ids=[0],
        masked_rows=masked_rows or [],
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_with_no_token_left_gets_no_token_and_the_others_are_untouched(temperature: float) -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    logits[1] = float("-inf")  # a grammar left nothing
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=temperature), SamplingParams()]
    params[2] = SamplingParams(
        temperature=temperature, allowed_token_ids=[7], stop_token_ids=[7], min_tokens=2
    )
    out = Sampler().sample(logits, _inputs(params, masked_rows=[1])).output()
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[1] == NO_TOKEN and out.token_ids[2] == NO_TOKEN


def test_a_row_pushed_to_infinity_by_a_penalty_gets_no_token(default_llm: Any) -> None:
    """repetition_penalty 1e-300 is 0 in float32: dividing by it makes logits infinite."""
    params = SamplingParams(temperature=1.0, repetition_penalty=1e-300, max_tokens=4, seed=0)
    out = default_llm.generate(["Hi there"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "abort" and out.token_ids == []
    normal = default_llm.generate(["Hi there"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(normal[0].outputs[0].token_ids) == 4
    default_llm.llm_engine.check_idle()


def test_a_nan_row_gets_no_token() -> None:
    logits = torch.zeros(2, 20)
    logits[0] = float("nan")
    out = Sampler().sample(logits, _inputs([SamplingParams(temperature=1.0)] * 2, masked_rows=[0])).output()
    assert out.token_ids[0] == NO_TOKEN and 0 <= out.token_ids[1] < 20


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 1e300}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"presence_penalty": float("inf")}, "presence_penalty"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {True: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [True]}, "allowed_token_ids"),
        ({"stop_token_ids": [False]}, "stop_token_ids"),
        ({"n": True}, "n"),
    ],
)
def test_non_finite_numbers_and_booleans_are_refused(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


# Every combination of the constraints that can leave a row with no token, sampled and greedy.
_CONSTRAINTS: dict[str, list[dict[str, Any]]] = {
    "min_tokens": [{}, {"min_tokens": 3}],
    "stop_ids": [{}, {"stop_token_ids": [42]}],
    "allowed": [{}, {"allowed_token_ids": [42]}, {"allowed_token_ids": [42, 43]}],
    "bad_words": [{}, {"bad_words": ["Hello"]}],
    "bias": [{}, {"logit_bias": {43: -100.0}}],
    "grammar": [{}, {"structured_outputs": StructuredOutputsParams(choice=["yes", "no"])}],
}


def _combinations() -> list[dict[str, Any]]:
    out = []
    for parts in itertools.product(*_CONSTRAINTS.values()):
        kwargs: dict[str, Any] = {}
        for part in parts:
            kwargs.update(part)
        out.append(kwargs)
    return out


def test_every_constraint_combination_ends_its_request_only(default_llm: Any) -> None:
    """The issue's reproductions and every combination of them: each request finishes (its tokens
    obey its constraints), the engine keeps serving, and a normal request in the same batch is
    unchanged."""
    llm = default_llm
    normal = SamplingParams(temperature=0, max_tokens=12)
    alone = llm.generate(["The capital of France is"], normal, use_tqdm=False)[0].outputs[0].token_ids
    prompts: list[str] = []
    params: list[SamplingParams] = []
    for kwargs in _combinations():
        for temperature in (0.0, 1.0):
            prompts.append("Hi")
            params.append(SamplingParams(temperature=temperature, max_tokens=8, seed=1, **kwargs))
    prompts.append("The capital of France is")
    params.append(normal)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for out, p in zip(outputs, params, strict=True):
        completion = out.outputs[0]
        assert out.finished and completion.finish_reason in ("stop", "length", "abort"), p
        if p.allowed_token_ids is not None:
            assert set(completion.token_ids) <= set(p.allowed_token_ids), p
        if p.stop_token_ids and p.min_tokens:
            assert not set(completion.token_ids[: p.min_tokens - 1]) & set(p.stop_token_ids), p
    assert outputs[-1].outputs[0].token_ids == alone
    # Allowed only the stop token, which min_tokens bans: nothing can be sampled.
    only_stop = llm.generate(
        ["Hi"],
        SamplingParams(
            temperature=1, allowed_token_ids=[42], stop_token_ids=[42], min_tokens=3, max_tokens=8
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert only_stop.finish_reason == "abort" and only_stop.token_ids == []
    llm.llm_engine.check_idle()


def test_colliding_sequence_ids_are_refused_and_change_nothing(default_llm: Any) -> None:
    engine = default_llm.llm_engine
    engine.add_request("X", "Tell me a story.", SamplingParams(n=2, max_tokens=6, ignore_eos=True))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("0_X", "Hi", SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("X", "Hi", SamplingParams(max_tokens=4))
    engine.add_request("Y", "Hi", SamplingParams(max_tokens=4, ignore_eos=True))
    finished: dict[str, Any] = {}
    for _ in range(100):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert sorted(finished) == ["X", "Y"]
    assert [len(c.token_ids) for c in finished["X"].outputs] == [6, 6]
    # The other order: a request "0_Z" first, then "Z" with n = 2 whose first sibling would be "0_Z".
    engine.add_request("0_Z", "Hi", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("Z", "Hi", SamplingParams(n=2, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_idle()


def test_n_is_bounded_by_max_num_seqs(default_llm: Any) -> None:
    engine = default_llm.llm_engine
    with pytest.raises(ValueError, match="n must be at most max_num_seqs"):
        engine.add_request("big-n", "Hi", SamplingParams(n=1_000_000_000, max_tokens=1))
    engine.check_idle()


def test_prompt_logprobs_are_computed_in_slices(default_llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prompt's logprobs never materialise full-vocabulary rows for every position at once."""
    runner = default_llm.llm_engine.runner
    rows: list[int] = []
    compute = runner.model.compute_logits

    def counting(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return compute(hidden, *args, **kwargs)

    monkeypatch.setattr(runner.model, "compute_logits", counting)
    prompt = list(range(100, 700))
    out = default_llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert max(rows) <= 256 and sum(r for r in rows if r > 1) >= len(prompt) - 1
    default_llm.llm_engine.check_idle()


def _async_engine(llm: Any, **kwargs: Any) -> AsyncLLMEngine:
    engine = AsyncLLMEngine(llm.llm_engine, log_stats_interval=None, **kwargs)
    engine.start()
    return engine


def test_queued_sequences_count_against_the_queue_bound(default_llm: Any) -> None:
    engine = _async_engine(default_llm, max_queued_requests=4)

    async def main() -> None:
        with pytest.raises(QueueFullError, match="adds 5"):
            await engine.add_request("many", "Hi", SamplingParams(n=5, max_tokens=2))
        stream = await engine.add_request("few", "Hi", SamplingParams(n=4, max_tokens=2))
        async for out in stream:
            last = out
        assert last.finished and len(last.outputs) == 4

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.shutdown()
    default_llm.llm_engine.check_idle()


def test_a_slow_grammar_compiles_off_the_engine_thread(default_llm: Any) -> None:
    """While a large grammar compiles, a running stream keeps getting tokens; a grammar over the time
    limit is refused with the field named."""
    # Thousands of distinct choices: compiling takes xgrammar long enough to be seen.
    choices = [f"option number {i} of many" for i in range(5000)]
    slow = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=choices))
    engine = _async_engine(default_llm, grammar_compile_timeout=60.0)

    async def main() -> tuple[float, float]:
        normal = await engine.add_request(
            "normal", "Count to fifty:", SamplingParams(max_tokens=60, ignore_eos=True)
        )
        times: list[float] = []

        async def consume() -> None:
            async for _ in normal:
                times.append(time.monotonic())

        consumer = asyncio.create_task(consume())
        while not times:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        constrained = await engine.add_request("slow", "Pick one:", slow)
        compile_s = time.monotonic() - started
        async for _ in constrained:
            pass
        await consumer
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        return compile_s, max(gaps)

    try:
        compile_s, max_gap = asyncio.run(asyncio.wait_for(main(), 120))
        print(f"grammar compile {compile_s:.2f} s, longest gap of the running stream {max_gap:.3f} s")
        assert max_gap < 1.0 or max_gap < compile_s / 2, (compile_s, max_gap)
        engine.grammar_compile_timeout = 1e-4
        other = SamplingParams(
            max_tokens=2,
            structured_outputs=StructuredOutputsParams(json=json.dumps({"enum": choices[:3000]})),
        )
        with pytest.raises(ValueError, match="structured_outputs"):
            asyncio.run(asyncio.wait_for(engine.add_request("late", "Hi", other), 60))
    finally:
        engine.shutdown()
    default_llm.llm_engine.check_idle()


def test_an_idle_engine_gives_freed_memory_back_once_per_idle_period(
    default_llm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = default_llm.llm_engine
    calls: list[bool] = []
    release = engine.executor.release_idle_memory
    monkeypatch.setattr(
        engine.executor,
        "release_idle_memory",
        lambda: calls.append(engine.has_unfinished_requests()) or release(),
    )
    params = SamplingParams(temperature=0, max_tokens=4)
    default_llm.generate(["Hello", "The sky is"], params, use_tqdm=False)
    assert calls == [False]  # once, after the last request finished (not after every step)
    for _ in range(3):
        engine.step()  # idle steps release nothing more
    assert calls == [False]
    default_llm.generate(["Again"], params, use_tqdm=False)
    assert calls == [False, False]
