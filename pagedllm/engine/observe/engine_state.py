"""A consistent snapshot of one engine for the dashboard: its KV block map, its requests and its
counters, built on demand from the engine's own objects.

:func:`build_state` must run on the thread that steps the engine, between two steps (the engine
thread of :class:`~pagedllm.engine.async_engine.AsyncLLMEngine`, which runs it as an
:class:`EngineCall`, or the step loop of an engine-core process): it reads the scheduler's queues
and the block pool, which only that thread changes, so the snapshot is one state the engine was in.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Callable
from typing import Any

import msgspec

from pagedllm.engine.observe.step_events import StepEvents, StepRecord, summarize

MAX_WAITING_ROWS = 256  # waiting requests listed in a snapshot (the queue's length is always given)
STATE_TIMEOUT_S = 10.0  # how long a caller waits for the engine thread to take a snapshot

# A block's entry in ``blocks``: its reference count when requests hold it, else one of these.
BLOCK_FREE = 0
BLOCK_CACHED = -1  # unreferenced but registered in the prefix cache (evictable)


def block_states(pool: Any) -> list[int]:
    """Per physical block: its ref count (> 0: in use), BLOCK_CACHED or BLOCK_FREE."""
    return [b.ref_cnt or (BLOCK_CACHED if b.block_hash is not None else BLOCK_FREE) for b in pool.blocks]


def _request_row(request: Any, block_size: int, with_blocks: bool) -> dict[str, Any]:
    row: dict[str, Any] = msgspec.structs.asdict(summarize(request))
    row["computed_tokens"] = request.num_computed_tokens
    row["priority"] = request.priority
    if with_blocks:
        row["block_ids"] = list(request.block_ids)  # logical block i holds tokens [i*bs, (i+1)*bs)
    if request.host_block_ids:  # swapped out: its KV is in these blocks of the host tier
        row["host_block_ids"] = list(request.host_block_ids)
    return row


def step_time_ms(scheduler: Any) -> float | None:
    """The step-time target in milliseconds (None: off)."""
    budget = getattr(scheduler, "step_budget", None)
    return None if budget is None else float(budget.target_s * 1000.0)


def build_state(engine: Any) -> dict[str, Any]:
    """The engine's state as JSON-ready data (see docs/DASHBOARD.md for the fields). Engine thread
    only, between steps."""
    events: StepEvents = engine.step_events
    events.collect_finished()
    manager = engine.kv_cache_manager
    pool = manager.pool
    scheduler = engine.scheduler
    block_size = manager.block_size
    stats = dataclasses.asdict(engine.get_stats())
    queries = stats.get("prefix_cache_queries", 0)
    stats["prefix_cache_hit_rate"] = stats.get("prefix_cache_hits", 0) / queries if queries else 0.0
    running = [_request_row(r, block_size, True) for r in scheduler.running]
    waiting = [
        _request_row(r, block_size, r.num_computed_tokens > 0)
        for r, _ in zip(scheduler.waiting, range(MAX_WAITING_ROWS), strict=False)
    ]
    return {
        "step": events.num_steps,
        "config": {
            "model": str(engine.model_name),
            "num_kv_blocks": pool.num_blocks,
            "block_size": block_size,
            "max_num_batched_tokens": scheduler.config.max_num_batched_tokens,
            "max_num_seqs": scheduler.config.max_num_seqs,
            "prefix_caching": bool(pool.enable_caching),
            "policy": scheduler.config.policy,
            "num_host_blocks": manager.host.pool.num_blocks if manager.host is not None else 0,
            "preemption_mode": scheduler.config.preemption_mode,
            "max_step_time_ms": step_time_ms(scheduler),
        },
        "stats": stats,
        "blocks": block_states(pool),
        "running": running,
        "waiting": waiting,
        "num_waiting": len(scheduler.waiting),
        "swapped": [_request_row(r, block_size, False) for r in scheduler.swapped],
        "finished": [msgspec.structs.asdict(s) for s in events.finished()],
    }


def encode_state(engine: Any) -> bytes:
    """:func:`build_state` as JSON bytes (what an engine core sends its front-ends)."""
    return msgspec.json.encode(build_state(engine))


class EngineCall:
    """A function for the engine thread to run between two steps; its result (or exception) goes
    to ``future``. A command of :class:`~pagedllm.engine.engine_core.EngineCore`."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def apply(self, engine: Any) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            self.future.set_result(self.fn(engine))
        except Exception as exc:  # noqa: BLE001 - the caller gets the failure
            self.future.set_exception(exc)


class EngineStateAccess:
    """The dashboard's view of an async engine: a snapshot taken on the engine thread, and the step
    records (read from the engine's ring under its lock). The engine in core processes overrides
    both (:class:`~pagedllm.engine.proc.async_mp_engine.AsyncMPEngine`)."""

    engine: Any
    _lock: Any

    def _send(self, command: Any) -> None:  # provided by the engine
        raise NotImplementedError

    @property
    def engine_ranks(self) -> list[int]:
        """The engines whose state can be asked for (one here; a core's rank each over processes)."""
        return [0]

    async def engine_state(self, rank: int = 0) -> bytes:
        """A snapshot (:func:`build_state`, as JSON) taken between two steps; TimeoutError after
        STATE_TIMEOUT_S, RuntimeError when the engine keeps no step record (or ``rank`` is not 0)."""
        if rank != 0 or not isinstance(getattr(self.engine, "step_events", None), StepEvents):
            raise RuntimeError(
                "This engine keeps no step record." if rank == 0 else f"No engine of rank {rank}."
            )
        call = EngineCall(encode_state)
        with self._lock:
            self._send(call)
        result: bytes = await asyncio.wait_for(asyncio.wrap_future(call.future), STATE_TIMEOUT_S)
        return result

    def step_records(self, since: int, limit: int | None = None, rank: int = 0) -> list[StepRecord]:
        """Step records after step ``since`` (the latest ``limit``), oldest first."""
        events = getattr(self.engine, "step_events", None) if rank == 0 else None
        if not isinstance(events, StepEvents):
            return []
        return events.since(since, limit)
