"""The scheduler's interleaved steps (pipeline stages each on a different step): a request whose
token is still in flight waits for it, and each step takes at most its share of the unfinished
requests, so consecutive steps hold disjoint groups of about equal size. With one step at a time a
running request decodes its pending token instead (scheduling ahead)."""

from __future__ import annotations

from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched.kv_cache_manager import KVCacheManager
from pagedllm.sched.scheduler import Scheduler, SchedulerConfig, SchedulerOutput


def make_scheduler(interleaved: int, num_requests: int, max_tokens: int = 50) -> Scheduler:
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024, interleaved_steps=interleaved),
        KVCacheManager(256, 16, True),
    )
    for i in range(num_requests):
        prompt = [1 + (7 * i + j) % 90 for j in range(8 + i)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        sched.add_request(Request(f"r{i}", prompt, params, max_tokens=max_tokens, eos_token_ids=[0]))
    return sched


def launch(sched: Scheduler) -> SchedulerOutput:
    """Schedule a step and mark it launched, as the engine does (its tokens pending)."""
    out = sched.schedule()
    for s in out.scheduled_requests:
        if s.needs_sample:
            s.request.num_pending_tokens += 1
    sched.update_after_step(out)
    return out


def resolve(out: SchedulerOutput) -> None:
    for s in out.scheduled_requests:
        if s.needs_sample:
            s.request.num_pending_tokens -= 1
            s.request.append_output_token(5)


def ids(out: SchedulerOutput) -> set[str]:
    return {s.request.request_id for s in out.scheduled_requests}


def test_two_interleaved_steps_alternate_two_groups() -> None:
    sched = make_scheduler(2, 6)
    in_flight = launch(sched)  # prompts of half the requests (3 of 6)
    assert len(in_flight.scheduled_requests) == 3
    steps = [in_flight]
    for _ in range(12):
        step = launch(sched)
        resolve(in_flight)
        in_flight = step
        steps.append(step)
    resolve(in_flight)
    first, second = ids(steps[0]), ids(steps[1])
    assert len(first) == len(second) == 3 and not first & second
    for k, step in enumerate(steps):
        assert ids(step) == (first if k % 2 == 0 else second), f"step {k}"


def test_groups_even_out_when_one_empties() -> None:
    """Three of one group's four requests finishing leave the groups at 1 and 4; the per-step share
    (at most ceil(5 / 2) = 3) moves the surplus over, and the steps settle at 3 and 2."""
    sched = make_scheduler(2, 8)
    first = launch(sched)
    in_flight = launch(sched)
    resolve(first)
    assert len(first.scheduled_requests) == len(in_flight.scheduled_requests) == 4
    sched.abort_requests(sorted(ids(first))[:3])
    sizes = []
    for _ in range(8):
        step = launch(sched)
        resolve(in_flight)
        in_flight = step
        sizes.append(len(step.scheduled_requests))
    resolve(in_flight)
    assert sizes[0] == 1 and max(sizes) == 3, sizes
    assert sizes[-4:] in ([3, 2, 3, 2], [2, 3, 2, 3]), sizes


def test_one_step_at_a_time_decodes_pending_tokens() -> None:
    sched = make_scheduler(1, 4)
    first = launch(sched)
    second = launch(sched)  # scheduled ahead: the same requests decode their pending tokens
    assert ids(first) == ids(second) == {"r0", "r1", "r2", "r3"}
    assert all(s.request.num_pending_tokens == 2 for s in second.scheduled_requests)
