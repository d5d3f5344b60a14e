"""The engine's step record and snapshot (the dashboard's data): what each step scheduled, preempted
and left waiting; the finished requests with their finish reasons; the KV block map with shared
prefix blocks; and memory that stays bounded over 10,000 steps nobody reads."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from helpers.model_factory import make_tiny_hf_model
from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.observe.engine_state import BLOCK_CACHED, BLOCK_FREE, build_state
from pagedllm.engine.observe.step_events import DECODE, MAX_WAITING_IDS, PREFILL, StepEvents
from pagedllm.request import Request, RequestStatus
from pagedllm.sched.kv_cache_manager import KVCacheManager
from pagedllm.sched.scheduler import Scheduler, SchedulerConfig

BLOCK = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_hf_model(tmp_path_factory.mktemp("step_events"), "llama", initializer_range=0.2)


def make_engine(model: str, **kwargs: object) -> LLMEngine:
    args: dict[str, object] = {"dtype": "float32", "block_size": BLOCK, "max_model_len": 256}
    args.update(kwargs)
    return LLMEngine.from_config(EngineConfig(model=model, **args))  # type: ignore[arg-type]


@pytest.fixture
def engine(tiny: str) -> Iterator[LLMEngine]:
    eng = make_engine(tiny, num_kv_blocks=64, max_num_batched_tokens=256)
    yield eng
    eng.shutdown()


def prompt(i: int, length: int = 40) -> list[int]:
    return [100 + (37 * i + 11 * j) % 3000 for j in range(length)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def drain(eng: LLMEngine) -> None:
    for _ in range(1000):
        if not eng.has_unfinished_requests():
            break
        eng.step()
    eng.check_idle()


def test_steps_record_prefill_then_decodes_and_finish_reasons(engine: LLMEngine) -> None:
    engine.add_request("a", prompt(1, 40), greedy(5))
    engine.add_request("b", prompt(2, 20), greedy(3))
    drain(engine)
    steps = engine.step_events.since(0)
    assert [s.step for s in steps] == list(range(1, len(steps) + 1))
    first = steps[0]
    assert first.scheduled == [("a", 40, PREFILL), ("b", 20, PREFILL)]
    assert first.num_batched_tokens == 60 and first.prompt_tokens == 60 and first.output_tokens == 2
    assert first.max_num_batched_tokens == 256 and first.num_kv_blocks == 64
    assert first.kv_blocks_used == 3 + 2  # ceil(41/16) + ceil(21/16): room for the first sampled token
    assert steps[1].scheduled == [("a", 1, DECODE), ("b", 1, DECODE)]
    decodes = {
        rid: sum(1 for s in steps for r, _, k in s.scheduled if r == rid and k == DECODE) for rid in "ab"
    }
    assert decodes == {"a": 4, "b": 2}  # max_tokens - 1 decodes after the prefill's token
    build_state(engine)  # looks at every watched request: the last ones ended after the last step
    finished = {f.request_id: f for f in engine.step_events.finished()}
    assert set(finished) == {"a", "b"}
    assert finished["a"].finish_reason == "length" and finished["a"].output_tokens == 5
    assert finished["a"].ttft_s is not None and finished["a"].ttft_s >= 0
    assert finished["b"].prompt_tokens == 20 and finished["b"].state == "finished_length"
    assert engine.step_events.num_watched == 0


def test_snapshot_marks_shared_prefix_blocks_and_owners(engine: LLMEngine) -> None:
    shared = prompt(7, 48)  # three full blocks
    engine.add_request("first", shared + [5, 6], greedy(20))
    engine.step()  # the first prompt is computed and its full blocks cached
    engine.add_request("second", shared + [8, 9], greedy(20))
    engine.step()
    state = build_state(engine)
    assert len(state["blocks"]) == 64 == state["config"]["num_kv_blocks"]
    running = {r["request_id"]: r for r in state["running"]}
    first, second = running["first"]["block_ids"], running["second"]["block_ids"]
    assert first[:3] == second[:3], "the cached prefix is shared"
    for block in first[:3]:
        assert state["blocks"][block] == 2
    assert running["second"]["cached_tokens"] == 48
    in_use = sum(1 for b in state["blocks"] if b > 0)
    assert (
        in_use
        == 64 - engine.kv_cache_manager.num_free_blocks
        == state["stats"]["num_kv_blocks"] - state["stats"]["num_free_blocks"]
    )
    engine.abort_request(["first", "second"])
    engine.check_idle()
    state = build_state(engine)
    assert all(b in (BLOCK_FREE, BLOCK_CACHED) for b in state["blocks"])
    assert sum(1 for b in state["blocks"] if b == BLOCK_CACHED) >= 3
    assert {f["request_id"]: f["finish_reason"] for f in state["finished"]} == {
        "first": "abort",
        "second": "abort",
    }
    assert not state["running"] and state["stats"]["prefix_cache_hit_rate"] > 0


def test_a_tiny_pool_records_preemptions(tiny: str) -> None:
    eng = make_engine(tiny, num_kv_blocks=8)
    try:
        for i in range(4):
            eng.add_request(f"r{i}", prompt(i, 30), greedy(40))
        drain(eng)
        steps = eng.step_events.since(0)
        preempted = [rid for s in steps for rid in s.preempted]
        assert preempted, "8 blocks cannot hold 4 requests of 70 tokens"
        assert eng.scheduler.num_preemptions == len(preempted)
        assert any(s.num_waiting and s.waiting for s in steps)
        eng.step_events.collect_finished()  # the last request ended after the last step
        reasons = {f.request_id: (f.finish_reason, f.num_preemptions) for f in eng.step_events.finished()}
        assert set(reasons) == {f"r{i}" for i in range(4)}
        assert all(r == "length" for r, _ in reasons.values())
        assert sum(n for _, n in reasons.values()) == len(preempted)
    finally:
        eng.shutdown()


def test_ten_thousand_unread_steps_stay_within_the_ring() -> None:
    """Real scheduler and KV cache manager, no model: 10,000 steps of a changing request mix."""
    manager = KVCacheManager(32, BLOCK, True)
    scheduler = Scheduler(SchedulerConfig(8, 64), manager)
    engine = SimpleNamespace(scheduler=scheduler, kv_cache_manager=manager)
    events = StepEvents(max_steps=128, max_finished=16)
    n = 0
    for step in range(10_000):
        while scheduler.num_waiting + scheduler.num_running < 60:
            params = SamplingParams(max_tokens=8)
            scheduler.add_request(Request(f"q{n}", prompt(n, 20), params, 8, []))
            n += 1
        out = scheduler.schedule()
        scheduler.update_after_step(out)
        events.record(out, engine, 0.001)
        for s in out.scheduled_requests:  # every request ends after its prefill and one decode
            req = s.request
            if req.num_computed_tokens > req.num_prompt_tokens or step % 7 == 0:
                scheduler.finish_request(req, RequestStatus.FINISHED_LENGTH)
            elif s.needs_sample:
                req.append_output_token(1)
    assert events.num_steps == 10_000 and len(events.steps) == 128
    assert events.since(0)[0].step == 10_000 - 127
    assert len(events.finished_requests) == 16
    assert events.num_watched <= scheduler.num_running + scheduler.num_waiting
    assert all(len(s.waiting) <= MAX_WAITING_IDS for s in events.steps)
    assert [s.step for s in events.since(9_990)] == list(range(9_991, 10_001))
    assert [s.step for s in events.since(0, limit=3)] == [9_998, 9_999, 10_000]
