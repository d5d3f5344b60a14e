"""Property-based tests of the block pool, KV cache manager and scheduler (no model involved)."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched.host_tier import SwapStats
from pagedllm.sched.kv_cache_manager import RELEASED_BLOCK, KVCacheManager
from pagedllm.sched.scheduler import Scheduler, SchedulerConfig

EOS = 0


def make_request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        params=SamplingParams(max_tokens=max_tokens, temperature=0),
        max_tokens=max_tokens,
        eos_token_ids=[EOS],
    )


def check_invariants(sched: Scheduler, kv_cache_manager: KVCacheManager) -> None:
    """Three queues, two pools: only running requests hold device blocks, only swapped ones host
    blocks, and every block's ref count is its number of holders."""
    pools = [(kv_cache_manager.pool, [r.block_ids for r in sched.running])]
    if kv_cache_manager.host is not None:
        pools.append((kv_cache_manager.host.pool, [r.host_block_ids for r in sched.swapped]))
    for r in sched.waiting:
        assert r.block_ids == [] and r.host_block_ids == [], "waiting requests hold no blocks"
    for r in sched.running:
        assert r.host_block_ids == [], "running requests hold no host blocks"
    for r in sched.swapped:
        assert r.block_ids == [] and r.host_block_ids, "swapped requests hold host blocks only"
        assert r.status == RequestStatus.SWAPPED and r.num_computed_tokens > 0
    ids = [r.request_id for q in (sched.waiting, sched.running, sched.swapped) for r in q]
    assert len(ids) == len(set(ids)), "a request is in one queue at most"
    for pool, tables in pools:
        held = Counter(b for table in tables for b in table if b != RELEASED_BLOCK)
        for block in pool.blocks:
            assert block.ref_cnt >= 0
            assert block.ref_cnt == held.get(block.block_id, 0), "ref count equals number of holders"
            assert (block.block_id in pool.free_queue) == (block.ref_cnt == 0)
        for h, block in pool.cached.items():
            assert block.block_hash == h
    for r in sched.running:
        assert len(r.block_ids) * kv_cache_manager.block_size >= r.num_computed_tokens
        released = [b == RELEASED_BLOCK for b in r.block_ids]
        assert released == sorted(released, reverse=True), "released entries are a prefix"
        window = kv_cache_manager.sliding_window
        if window is None:
            assert not any(released)
        else:
            # Never a block that a token still to compute reads (keys from num_computed - window + 1).
            first_needed = max(0, r.num_computed_tokens - window + 1) // kv_cache_manager.block_size
            assert sum(released) <= first_needed


def drive(
    ops: list[tuple[str, int]],
    num_blocks: int,
    block_size: int,
    max_seqs: int,
    budget: int,
    caching: bool,
    seed: int,
    window: int | None = None,
    policy: str = "fcfs",
    host_blocks: int = 0,
) -> SwapStats | None:
    rng = random.Random(seed)
    kv_cache_manager = KVCacheManager(
        num_blocks, block_size, caching, sliding_window=window, num_host_blocks=host_blocks
    )
    mode = "swap" if host_blocks else "recompute"
    sched = Scheduler(
        SchedulerConfig(max_seqs, budget, policy=policy, preemption_mode=mode), kv_cache_manager
    )
    kv = KVContents(block_size)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(1, 40))] for _ in range(3)]
    next_id = 0
    alive: list[str] = []
    tables: dict[str, list[int]] = {}  # the worker's block tables, kept from the outputs alone

    def step() -> None:
        out = sched.schedule()
        if not out.is_empty:
            check_worker_tables(tables, out, sched)
        assert out.num_batched_tokens <= budget
        assert sum(s.num_tokens for s in out.scheduled_requests) == out.num_batched_tokens
        assert len(sched.running) <= max_seqs
        for s in out.scheduled_requests:
            assert s.num_tokens >= 1
            assert s.request.status == RequestStatus.RUNNING
            need = s.request.num_computed_tokens + s.num_tokens
            assert len(s.request.block_ids) * block_size >= need, "KV room for the scheduled tokens"
            if window is not None:
                first_key = max(0, s.request.num_computed_tokens - window + 1)
                ids = s.request.block_ids[first_key // block_size : -(-need // block_size)]
                assert RELEASED_BLOCK not in ids, "every block the step reads is held"
                held = kv_cache_manager.num_held_blocks(s.request)
                assert held <= -(-(window - 1 + s.num_tokens) // block_size) + 1, "window bound"
        kv.run_step(out, window)
        sampled = [s.request for s in out.scheduled_requests if s.needs_sample]
        sched.update_after_step(out)
        for req in sampled:
            tok = rng.randrange(0, 50)
            req.append_output_token(tok)
            if tok == EOS or req.num_output_tokens >= req.max_tokens:
                sched.finish_request(req, RequestStatus.FINISHED_STOPPED)
        check_invariants(sched, kv_cache_manager)
        if policy == "priority":
            keys = [(r.priority, r.arrival_order) for r in sched.waiting]
            assert keys == sorted(keys), "waiting is in (priority, arrival) order"
            keys = [(r.priority, r.arrival_order) for r in sched.running]
            assert keys == sorted(keys), "running is in (priority, arrival) order"
        keys = [(r.priority if policy == "priority" else 0, r.arrival_order) for r in sched.swapped]
        assert keys == sorted(keys), "swapped is in the policy's order (arrival under FCFS)"

    for op, arg in ops:
        if op == "add":
            prompt = list(prefixes[arg % 3]) + [rng.randrange(1, 50) for _ in range(arg % 23)]
            max_tokens = 1 + arg % 17
            if -(-(len(prompt) + max_tokens) // block_size) > num_blocks:
                continue
            rid = f"r{next_id}"
            next_id += 1
            request = make_request(rid, prompt, max_tokens)
            if policy == "priority":
                request.priority = arg % 3
            sched.add_request(request)
            alive.append(rid)
        elif op == "abort" and alive:
            sched.abort_requests([alive.pop(arg % len(alive))])
            check_invariants(sched, kv_cache_manager)
        else:
            step()
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        step()
    assert not sched.has_unfinished_requests(), "every request finishes"
    kv_cache_manager.check_idle()
    return kv_cache_manager.host.stats if kv_cache_manager.host is not None else None


def check_worker_tables(tables: dict[str, list[int]], out, sched: Scheduler) -> None:
    """Apply a step's dropped tables and block-table changes to ``tables`` as the worker does, and
    check that they hold every scheduled request's blocks (entries released from a window aside)
    and that the worker holds a table for exactly the running requests."""
    for rid in out.dropped_tables:
        tables.pop(rid, None)
    for change in out.block_table_changes:
        table = tables.setdefault(change.request_id, [])
        assert change.start <= len(table), "a change never leaves a gap"
        table[change.start :] = change.block_ids
    for s in out.scheduled_requests:
        r = s.request
        table = tables[r.request_id]
        assert len(table) == len(r.block_ids), f"{r.request_id}: table length"
        assert all(b in (RELEASED_BLOCK, t) for t, b in zip(table, r.block_ids, strict=True)), (
            f"{r.request_id}: ids"
        )
    assert set(tables) == {r.request_id for r in sched.running}, "tables of exactly the running requests"


class KVContents:
    """What a step's copies and forward leave in the two tiers, slot by slot: the token whose KV a
    slot holds. Checks that every position a scheduled request reads holds its own token's KV."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.device: dict[tuple[int, int], int] = {}
        self.host: dict[tuple[int, int], int] = {}

    def run_step(self, out, window: int | None) -> None:
        bs = self.block_size
        for d, h in out.copies_out:  # all copies out, then all copies in, then the forward
            for o in range(bs):
                self.host[(h, o)] = self.device.get((d, o), -1)
        for h, d in out.copies_in:
            for o in range(bs):
                self.device[(d, o)] = self.host.get((h, o), -1)
        for s in out.scheduled_requests:
            r = s.request
            for p in range(r.num_computed_tokens, min(r.num_computed_tokens + s.num_tokens, r.num_tokens)):
                self.device[(r.block_ids[p // bs], p % bs)] = r.all_token_ids[p]
        for s in out.scheduled_requests:
            r = s.request
            end = min(r.num_computed_tokens + s.num_tokens, r.num_tokens)
            first = 0 if window is None else max(0, r.num_computed_tokens - window + 1)
            for p in range(first, end):
                slot = (r.block_ids[p // bs], p % bs)
                assert self.device.get(slot) == r.all_token_ids[p], f"{r.request_id} position {p} KV"


op_strategy = st.lists(
    st.tuples(st.sampled_from(["add", "add", "step", "step", "step", "abort"]), st.integers(0, 1000)),
    max_size=60,
)
# The scheduler and pool settings every random-operations test draws.
SCHEDULER_CASES = {
    "ops": op_strategy,
    "num_blocks": st.integers(4, 40),
    "block_size": st.sampled_from([1, 2, 4, 16]),
    "max_seqs": st.integers(1, 8),
    "budget": st.integers(1, 64),
    "caching": st.booleans(),
    "seed": st.integers(0, 2**16),
}


@settings(max_examples=150, deadline=None)
@given(**SCHEDULER_CASES)
def test_random_add_step_abort_keeps_invariants(ops, num_blocks, block_size, max_seqs, budget, caching, seed):
    drive(ops, num_blocks, block_size, max_seqs, budget, caching, seed)


@settings(max_examples=150, deadline=None)
@given(**SCHEDULER_CASES, window=st.integers(1, 40))
def test_random_add_step_abort_with_a_sliding_window(
    ops, num_blocks, block_size, max_seqs, budget, caching, seed, window
):
    """Blocks leave a request once out of its window; ref counts, the idle state and the blocks each
    step reads stay right."""
    drive(ops, num_blocks, block_size, max_seqs, budget, caching, seed, window)


@settings(max_examples=150, deadline=None)
@given(**SCHEDULER_CASES)
def test_random_add_step_abort_under_priority(ops, num_blocks, block_size, max_seqs, budget, caching, seed):
    """Priorities 0-2, urgent arrivals preempting less urgent running requests: the same invariants,
    both queues in (priority, arrival) order, and every request finishes."""
    drive(ops, num_blocks, block_size, max_seqs, budget, caching, seed, policy="priority")


@settings(max_examples=150, deadline=None)
@given(
    **SCHEDULER_CASES,
    host_blocks=st.integers(1, 40),
    priority=st.booleans(),
    window=st.none() | st.integers(1, 40),
)
def test_random_add_step_abort_with_a_host_tier(
    ops, num_blocks, block_size, max_seqs, budget, caching, seed, host_blocks, priority, window
):
    """Preemption by swapping, swaps back in, the host prefix cache: three queues and two pools keep
    their invariants, every position a step reads holds its token's KV (copies out before copies in
    before the forward), and both pools are idle at the end."""
    policy = "priority" if priority else "fcfs"
    drive(ops, num_blocks, block_size, max_seqs, budget, caching, seed, window, policy, host_blocks)


def test_long_random_runs_with_a_host_tier():
    """Long runs (hypothesis mostly draws short ones): enough pressure that requests swap out, come
    back and hit the host prefix cache, with every check of the drive above."""
    rng = random.Random(2024)
    totals = Counter()
    for case in range(200):
        ops = [
            (rng.choice(["add", "add", "step", "step", "step", "abort"]), rng.randrange(1000))
            for _ in range(60)
        ]
        manager_stats = drive(
            ops,
            num_blocks=rng.randrange(4, 40),
            block_size=rng.choice([1, 2, 4, 16]),
            max_seqs=rng.randrange(1, 8),
            budget=rng.randrange(1, 64),
            caching=rng.random() < 0.5,
            seed=case,
            window=None if case % 2 else rng.randrange(1, 40),
            policy="priority" if case % 3 == 0 else "fcfs",
            host_blocks=rng.randrange(1, 40),
        )
        assert manager_stats is not None
        totals.update(swapped_out=manager_stats.swapped_out, swapped_in=manager_stats.swapped_in)
        totals.update(host_hits=manager_stats.host_hit_tokens)
    assert totals["swapped_out"] > 100 and totals["swapped_in"] > 100 and totals["host_hits"] > 100, totals


def test_sliding_window_releases_blocks_and_skips_old_hits():
    manager = KVCacheManager(16, 4, True, sliding_window=6)
    a = make_request("a", list(range(1, 22)), 4)  # 21 tokens: 5 full blocks
    assert manager.allocate_slots(a, 21)
    a.num_computed_tokens = 21
    manager.cache_full_blocks(a)
    first = list(a.block_ids)
    assert manager.allocate_slots(a, 1)  # the next token (position 21) reads keys 16..21
    assert a.block_ids[:4] == [RELEASED_BLOCK] * 4 and a.block_ids[4:] == first[4:]
    assert manager.num_held_blocks(a) == 2 and manager.num_free_blocks == 14
    # The released blocks stay cached: an identical prompt hits all five full blocks but takes only
    # those its first computed token (position 20, keys 15..20) reads.
    b = make_request("b", list(range(1, 22)), 4)
    hits, n = manager.get_computed_blocks(b)
    assert n == 20 and [h.block_id for h in hits] == first[:5]
    assert manager.allocate_slots(b, 1, hits)
    assert b.block_ids[:3] == [RELEASED_BLOCK] * 3 and b.block_ids[3:5] == first[3:5]
    assert len(b.block_hashes) == 5
    manager.free(a)
    manager.free(b)
    manager.check_idle()


def test_prefix_cache_hit_reuses_blocks_and_leaves_one_token():
    kv_cache_manager = KVCacheManager(16, 4, True)
    a = make_request("a", list(range(1, 13)), 4)  # 12 tokens = 3 full blocks
    hits, n = kv_cache_manager.get_computed_blocks(a)
    assert (hits, n) == ([], 0)
    assert kv_cache_manager.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    kv_cache_manager.cache_full_blocks(a)
    kv_cache_manager.free(a)
    b = make_request("b", list(range(1, 13)), 4)  # identical prompt: at most 2 blocks reused
    hits, n = kv_cache_manager.get_computed_blocks(b)
    assert n == 8 and [h.block_id for h in hits] == a_blocks_prefix(kv_cache_manager, b, 2)
    c = make_request("c", list(range(1, 9)) + [99, 98, 97, 96, 95], 4)
    hits_c, n_c = kv_cache_manager.get_computed_blocks(c)
    assert n_c == 8
    d = make_request("d", [7] + list(range(2, 13)), 4)  # first block differs: no hit at all
    assert kv_cache_manager.get_computed_blocks(d)[1] == 0


def test_requests_admitted_in_one_step_share_the_prefix_being_computed():
    kv_cache_manager = KVCacheManager(16, 4, True)
    sched = Scheduler(SchedulerConfig(4, 64), kv_cache_manager)
    a = make_request("a", list(range(1, 14)), 2)  # 13 tokens: 3 full blocks
    b = make_request("b", list(range(1, 13)) + [77], 2)  # same first 3 blocks
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled_requests] == ["a", "b"]
    assert b.num_computed_tokens == 12 and b.num_cached_tokens == 12
    assert b.block_ids[:3] == a.block_ids[:3]
    assert [s.num_tokens for s in out.scheduled_requests] == [13, 1]
    assert out.newly_cached_blocks == a.block_ids[:3]
    # Had the forward failed, the engine drops those entries: nothing matches them any more.
    kv_cache_manager.uncache(out.newly_cached_blocks)
    c = make_request("c", list(range(1, 14)), 2)
    assert kv_cache_manager.get_computed_blocks(c) == ([], 0)
    for r in (a, b):
        sched.finish_request(r, RequestStatus.FINISHED_ABORTED)
    kv_cache_manager.check_idle()


def a_blocks_prefix(kv_cache_manager: KVCacheManager, req: Request, n: int) -> list[int]:
    hits, _ = kv_cache_manager.get_computed_blocks(req)
    return [h.block_id for h in hits[:n]]


def test_lru_eviction_prefers_oldest_freed_blocks():
    kv_cache_manager = KVCacheManager(4, 2, True)
    a = make_request("a", [1, 2, 3, 4, 5], 1)
    assert kv_cache_manager.allocate_slots(a, 5)  # 3 blocks
    a.num_computed_tokens = 5
    kv_cache_manager.cache_full_blocks(a)  # blocks for [1,2] and [3,4] cached
    kv_cache_manager.free(a)
    assert kv_cache_manager.num_free_blocks == 4
    # A new unrelated request taking 2 blocks must first use never-cached blocks and the tail block.
    b = make_request("b", [9, 9, 9], 1)
    assert kv_cache_manager.allocate_slots(b, 3)
    again = make_request("c", [1, 2, 3, 4, 5], 1)
    assert kv_cache_manager.get_computed_blocks(again)[1] == 4, (
        "cached prefix survives while free blocks remain"
    )


def test_allocation_failure_changes_nothing():
    kv_cache_manager = KVCacheManager(2, 4, True)
    a = make_request("a", list(range(1, 20)), 1)
    before = kv_cache_manager.num_free_blocks
    assert not kv_cache_manager.allocate_slots(a, 19)
    assert kv_cache_manager.num_free_blocks == before and a.block_ids == []


def test_preemption_when_blocks_run_out_is_counted_and_recovers():
    kv_cache_manager = KVCacheManager(6, 2, True)
    sched = Scheduler(SchedulerConfig(4, 64), kv_cache_manager)
    reqs = [make_request(f"r{i}", [i + 1] * 3, 6) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    steps = 0
    while sched.has_unfinished_requests() and steps < 200:
        out = sched.schedule()
        sched.update_after_step(out)
        for s in out.scheduled_requests:
            if s.needs_sample:
                s.request.append_output_token(1)
                if s.request.num_output_tokens >= s.request.max_tokens:
                    sched.finish_request(s.request, RequestStatus.FINISHED_LENGTH)
        steps += 1
    assert not sched.has_unfinished_requests()
    assert sched.num_preemptions > 0
    assert all(r.num_output_tokens == 6 for r in reqs)
    kv_cache_manager.check_idle()
