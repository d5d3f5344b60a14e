"""Pipeline stages working on different steps at once (the engine's scheduling ahead over ``pp``
stages): each step holds requests whose latest token is on the host, so consecutive steps hold
disjoint groups and every stage has a step to run. Greedy and seeded-sampled outputs (penalties
included, which read the host's tokens) equal one rank's; three stages keep two steps in flight; a
given layer partition is the one used; and ranks idle for longer than the collectives' timeout
still serve the next request.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from helpers.prompts import PROMPTS
from pagedllm import LLM, SamplingParams
from pagedllm.sched.scheduler import SchedulerOutput

ARGS: dict[str, Any] = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 96}
WORKLOAD = PROMPTS[:8]
GREEDY = SamplingParams(temperature=0, max_tokens=20, logprobs=2, ignore_eos=True)
# Seeded rows draw from their own generators, so their tokens do not depend on the batch; the
# penalties read every earlier output token of the request.
SAMPLED = [
    SamplingParams(
        temperature=0.9,
        top_p=0.9,
        seed=100 + i,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        max_tokens=20,
        ignore_eos=True,
    )
    for i in range(len(WORKLOAD))
]

Tokens = list[list[int]]


def generate(llm: LLM) -> tuple[Tokens, Tokens]:
    greedy = [o.outputs[0].token_ids for o in llm.generate(WORKLOAD, GREEDY, use_tqdm=False)]
    sampled = [o.outputs[0].token_ids for o in llm.generate(WORKLOAD, SAMPLED, use_tqdm=False)]
    llm.llm_engine.check_idle()
    return greedy, sampled


_references: dict[str, tuple[Tokens, Tokens]] = {}


def reference(path: str) -> tuple[Tokens, Tokens]:
    if path not in _references:
        llm = LLM(path, **ARGS)
        _references[path] = generate(llm)
        llm.shutdown()
    return _references[path]


class StepLog:
    """The requests of every launched step (all, and those that sample) and the steps in flight."""

    def __init__(self, llm: LLM) -> None:
        engine = llm.llm_engine
        self.scheduled: list[set[str]] = []
        self.sampled: list[set[str]] = []
        self.most_in_flight = 0
        launch = engine.executor.launch

        def logged(out: SchedulerOutput, times: Any) -> Any:
            self.most_in_flight = max(self.most_in_flight, len(engine._in_flight))
            self.scheduled.append({s.request.request_id for s in out.scheduled_requests})
            self.sampled.append({s.request.request_id for s in out.scheduled_requests if s.needs_sample})
            return launch(out, times)

        engine.executor.launch = logged  # type: ignore[method-assign]

    def assert_interleaved(self) -> None:
        """No step holds a request whose token the step before it samples, and the stages really
        had two groups: many consecutive pairs of steps both sample."""
        pairs = list(zip(self.sampled[:-1], self.scheduled[1:], strict=True))
        assert all(not (a & b) for a, b in pairs), "a request ran while its token was in flight"
        both = sum(bool(a) and bool(b) for a, b in zip(self.sampled[:-1], self.sampled[1:], strict=True))
        assert both >= 20, f"only {both} consecutive pairs of sampling steps"


def test_two_stages_run_two_groups_and_equal_one_rank(tiny_model: Callable[[str], str], procs: Any) -> None:
    path = tiny_model("llama_tied")
    ref = reference(path)
    llm = LLM(path, pipeline_parallel_size=2, **ARGS)
    try:
        engine = llm.llm_engine
        assert engine.async_scheduling and engine.scheduler.config.interleaved_steps == 2
        assert engine.max_in_flight == 1
        log = StepLog(llm)
        assert generate(llm) == ref
        log.assert_interleaved()
        assert log.most_in_flight == 1
        # Groups of about equal size: no decode step holds more than half the requests (rounded up).
        assert max(len(s) for s in log.sampled) <= len(WORKLOAD) // 2
    finally:
        llm.shutdown()
    # The same pipeline without scheduling ahead (steps one at a time, cut into micro-batches).
    llm = LLM(path, pipeline_parallel_size=2, async_scheduling=False, **ARGS)
    try:
        assert llm.llm_engine.scheduler.config.interleaved_steps == 1
        assert generate(llm) == ref
    finally:
        llm.shutdown()
    procs.assert_none_left()


def test_three_stages_keep_two_steps_in_flight(tiny_model: Callable[[str], str], procs: Any) -> None:
    path = tiny_model("llama4l")
    ref = reference(path)
    llm = LLM(path, pipeline_parallel_size=3, **ARGS)
    try:
        engine = llm.llm_engine
        assert engine.scheduler.config.interleaved_steps == 3 and engine.max_in_flight == 2
        log = StepLog(llm)
        assert generate(llm) == ref
        log.assert_interleaved()
        assert log.most_in_flight == 2
    finally:
        llm.shutdown()
    procs.assert_none_left()


def test_given_layer_partition_is_used(tiny_model: Callable[[str], str], procs: Any) -> None:
    path = tiny_model("llama4l")
    llm = LLM(path, pipeline_parallel_size=2, pipeline_layer_partition="3,1", **ARGS)
    try:
        runner = llm.llm_engine.executor.parallel_runner  # type: ignore[union-attr]
        assert runner.stage_layers == range(0, 3) and len(runner.model.layers) == 3
        assert generate(llm) == reference(path)
    finally:
        llm.shutdown()
    procs.assert_none_left()


def test_ranks_idle_longer_than_the_timeout_still_serve(tiny_model: Callable[[str], str], procs: Any) -> None:
    """A rank waits for the driver's next command for as long as the engine is idle (the collectives'
    timeout bounds a step, not the wait between steps)."""
    path = tiny_model("llama")
    # The timeout also bounds the start-up collectives (ranks loading their shards at different
    # speeds on a loaded machine), so it is not made smaller than this.
    llm = LLM(path, tensor_parallel_size=2, distributed_timeout_s=10.0, **ARGS)
    try:
        first = generate(llm)
        time.sleep(12.0)
        assert len(procs.ranks()) == 1, "a rank exited while the engine was idle"
        assert generate(llm) == first
        # Greedy tokens against one rank. Seeded samples are not compared: two ranks sum their partial
        # products in another order than one rank (logprobs differ by about 5e-6), which may move a
        # draw across a token's boundary.
        assert first[0] == reference(path)[0]
    finally:
        llm.shutdown()
    procs.assert_none_left()
