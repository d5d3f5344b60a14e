"""Priority scheduling (``scheduling_policy="priority"``): requests run in (priority, arrival) order,
lower values first. Under a full KV pool an urgent arrival gets in at the next step by preempting
less urgent running requests and finishes first; the least urgent running request is the one
preempted when blocks run out; equal priorities keep arrival order; the tokens are those of an
unpressured FCFS engine; bad priorities are refused naming the field, changing nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.model_factory import make_tiny_hf_model
from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.request import RequestStatus

BLOCK = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_hf_model(tmp_path_factory.mktemp("priority"), "llama", initializer_range=0.2)


def prompt(i: int, length: int = 40) -> list[int]:
    return [100 + (37 * i + 11 * j) % 3000 for j in range(length)]


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def engine(model: str, **kwargs: object) -> LLMEngine:
    args: dict[str, object] = {"dtype": "float32", "block_size": BLOCK, "max_model_len": 256}
    args.update(kwargs)
    return LLMEngine.from_config(EngineConfig(model=model, **args))  # type: ignore[arg-type]


def run(eng: LLMEngine) -> tuple[list[str], dict[str, list[int]]]:
    """Step until idle: the order requests finished in, and their tokens."""
    order: list[str] = []
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                order.append(out.request_id)
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    eng.check_idle()
    return order, tokens


@pytest.fixture(scope="module")
def reference(tiny: str) -> Iterator[dict[str, list[int]]]:
    """Tokens of every request of these tests on an FCFS engine with room for all of them."""
    eng = engine(tiny, num_kv_blocks=256)
    for i in range(8):
        eng.add_request(f"low{i}", prompt(i), params(60))
    eng.add_request("urgent", prompt(99), params(30))
    yield run(eng)[1]
    eng.shutdown()


def test_urgent_arrival_gets_in_at_once_and_finishes_first(
    tiny: str, reference: dict[str, list[int]]
) -> None:
    # 8 requests of 40 + 60 tokens need 7 blocks each at the end: 16 blocks hold 5 prompts, 2 whole requests.
    eng = engine(tiny, num_kv_blocks=16, scheduling_policy="priority")
    for i in range(8):
        eng.add_request(f"low{i}", prompt(i), params(60), priority=1)
    for _ in range(5):
        eng.step()
    sched = eng.scheduler
    assert sched.waiting and eng.kv_cache_manager.num_free_blocks < 3, "the pool is not full"
    started = {r.request_id for r in sched.running}
    eng.add_request("urgent", prompt(99), params(30), priority=0)
    eng.step()
    urgent = next(r for r in sched.running if r.request_id == "urgent")
    assert urgent.status == RequestStatus.RUNNING and urgent.num_computed_tokens > 0, (
        "not admitted in one step"
    )
    assert sched.num_preemptions > 0, "no less urgent request was preempted"
    order, tokens = run(eng)
    assert order[0] == "urgent", order
    assert started <= set(order[1:])
    assert tokens == reference, "priorities changed the tokens"
    eng.shutdown()


def test_least_urgent_running_request_is_preempted_first(tiny: str, reference: dict[str, list[int]]) -> None:
    # Three running requests outgrow a 16-block pool; the priority 2 one (not the newest) goes first.
    eng = engine(tiny, num_kv_blocks=16, scheduling_policy="priority")
    for i, urgency in [(0, 0), (1, 2), (2, 1)]:
        eng.add_request(f"low{i}", prompt(i), params(60), priority=urgency)
    eng.step()
    assert [r.request_id for r in eng.scheduler.running] == ["low0", "low2", "low1"], (
        "running in priority order"
    )
    while eng.scheduler.num_preemptions == 0 and eng.has_unfinished_requests():
        eng.step()
    preempted = {rid: r.num_preemptions for rid, r in eng.scheduler.requests.items()}
    assert preempted["low1"] == 1 and preempted["low0"] == preempted["low2"] == 0, preempted
    _, tokens = run(eng)
    assert tokens == {rid: reference[rid] for rid in tokens}
    eng.shutdown()


def test_equal_priorities_keep_arrival_order_and_ties_break_by_arrival(tiny: str) -> None:
    eng = engine(tiny, num_kv_blocks=64, scheduling_policy="priority", max_num_seqs=1)
    urgencies = [2, 1, 2, 1, 0, 1]
    for i, urgency in enumerate(urgencies):
        eng.add_request(f"r{i}", prompt(i, 8), params(4), priority=urgency)
    order, _ = run(eng)
    assert order == ["r4", "r1", "r3", "r5", "r0", "r2"]
    # All one priority: plain arrival order, as FCFS.
    for i in range(5):
        eng.add_request(f"s{i}", prompt(i, 8), params(4), priority=7)
    assert run(eng)[0] == [f"s{i}" for i in range(5)]
    eng.shutdown()


def test_bad_priorities_are_refused_naming_the_field(tiny: str) -> None:
    fcfs = LLM(tiny, dtype="float32", num_kv_blocks=32, max_model_len=256)
    with pytest.raises(ValueError, match="priority 3.*scheduling_policy 'priority'"):
        fcfs.generate(["a b c"], params(4), priority=[3])
    with pytest.raises(ValueError, match="priority has 1 entries but there are 2 prompts"):
        fcfs.generate(["a", "b"], params(4), priority=[0])
    eng = fcfs.llm_engine
    for bad in ["high", 1.5, True, None]:
        with pytest.raises(ValueError, match="priority must be an integer"):
            eng.add_request("bad", "a b c", params(4), priority=bad)  # type: ignore[arg-type]
    assert not eng.has_unfinished_requests()
    eng.check_idle()
    assert len(fcfs.generate(["a b c"], params(4), priority=[0])[0].outputs[0].token_ids) == 4
    fcfs.shutdown()
    with pytest.raises(ValueError, match="scheduling_policy must be 'fcfs' or 'priority'"):
        EngineConfig(scheduling_policy="lifo")


def test_llm_generate_takes_priorities(tiny: str, reference: dict[str, list[int]], tmp_path: Path) -> None:
    llm = LLM(tiny, dtype="float32", num_kv_blocks=24, max_model_len=256, scheduling_policy="priority")
    prompts = [prompt(i) for i in range(4)]
    outs = llm.generate(prompts, params(60), use_tqdm=False, priority=[3, 2, 1, 0])
    assert [o.outputs[0].token_ids for o in outs] == [reference[f"low{i}"] for i in range(4)]
    llm.llm_engine.check_idle()
    llm.shutdown()
