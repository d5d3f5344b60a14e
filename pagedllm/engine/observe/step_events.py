"""A bounded record of the engine's latest steps and finished requests (the dashboard's data).

The engine calls :meth:`StepEvents.record` at the end of every launched step, whether or not anyone
reads the record. Memory stays bounded: at most ``max_steps`` :class:`StepRecord` and
``max_finished`` :class:`RequestSummary` are kept (two ``deque(maxlen=...)``), and the requests
being watched for their end are exactly those scheduled in some step that have not been seen
finished yet (each is dropped once finished, and unfinished requests are bounded by the engine).

Thread safety: ``record`` runs on the engine's thread; the readers (:meth:`StepEvents.since`,
:meth:`StepEvents.finished`) may run on any thread: both sides hold ``lock`` only for a deque
operation, so a reader never sees a half-updated buffer and never iterates a deque that changes.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import msgspec

from pagedllm.request import Request
from pagedllm.sched.scheduler import SchedulerOutput

DEFAULT_MAX_STEPS = 1024  # step records kept (the dashboard shows the latest 64)
DEFAULT_MAX_FINISHED = 256  # finished requests kept for the requests table
MAX_WAITING_IDS = 32  # waiting request ids named per step (the queue's length is always given)
SWEEP_EVERY = 64  # steps between sweeps of every watched request for an end outside any step

PREFILL = "prefill"
DECODE = "decode"


class StepRecord(msgspec.Struct, frozen=True, gc=False):
    """What one engine step did. Immutable; travels as is from an engine core to its front-ends."""

    step: int  # the step's number in this engine, from 1
    time: float  # wall-clock time (time.time()) when the step was launched
    duration_s: float  # seconds spent scheduling and launching the step
    batch_size: int  # requests scheduled in the step
    num_batched_tokens: int  # tokens computed by the step
    max_num_batched_tokens: int  # the step's token budget
    # (request id, tokens computed, PREFILL or DECODE) per scheduled request, in batch order.
    scheduled: list[tuple[str, int, str]]
    prompt_tokens: int  # of num_batched_tokens, prompt tokens (prefill chunks)
    output_tokens: int  # requests that sample a token in this step
    preempted: list[str]  # requests preempted by this step's schedule (recompute or swap)
    swapped_out: list[str]  # of those, requests whose KV went to the host tier
    swapped_in: list[str]  # swapped requests brought back by this step
    waiting: list[str]  # the first MAX_WAITING_IDS waiting requests after the schedule
    num_waiting: int  # length of the waiting queue after the schedule
    num_running: int  # length of the running queue after the schedule
    kv_blocks_used: int  # KV blocks referenced by requests after the schedule
    num_kv_blocks: int  # KV blocks in the pool
    # the first MAX_WAITING_IDS requests swapped out to the host tier after the schedule
    swapped: list[str] = msgspec.field(default_factory=list)


class RequestSummary(msgspec.Struct, frozen=True, gc=False):
    """One request as the requests table shows it."""

    request_id: str  # the sequence's id (``{i}_{id}`` for the i-th of n > 1 sequences)
    state: str  # RequestStatus value: waiting, running, preempted, finished_*
    prompt_tokens: int  # tokens of the prompt
    output_tokens: int  # tokens generated so far
    cached_tokens: int  # prompt tokens found in the prefix cache at first schedule (-1: not yet)
    ttft_s: float | None  # seconds from arrival to the first token (None: none yet)
    itl_s: float | None  # mean seconds between its tokens (None: fewer than two)
    num_preemptions: int  # times it was preempted
    finish_reason: str | None  # stop, length or abort once finished
    finished_time: float | None  # wall-clock time it was seen finished


def summarize(request: Request, finished_time: float | None = None) -> RequestSummary:
    """A request's row of the requests table (times come from the request's monotonic clock)."""
    first, last = request.first_token_time, request.last_token_time
    n_out = len(request.output_token_ids)
    ttft = first - request.arrival_time if first is not None else None
    itl = (last - first) / (n_out - 1) if first is not None and last is not None and n_out > 1 else None
    return RequestSummary(
        request.request_id,
        request.status.value,
        len(request.prompt_token_ids),
        n_out,
        request.num_cached_tokens,
        ttft,
        itl,
        request.num_preemptions,
        request.status.finish_reason,
        finished_time,
    )


class StepRing:
    """A bounded, thread-safe ring of :class:`StepRecord` in step order (a front-end keeps one per
    engine core, filled from the core's outputs)."""

    def __init__(self, max_steps: int = DEFAULT_MAX_STEPS) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, got {max_steps}.")
        self.lock = threading.Lock()
        self.steps: deque[StepRecord] = deque(maxlen=max_steps)

    def extend(self, records: list[StepRecord]) -> None:
        with self.lock:
            self.steps.extend(records)

    def since(self, step: int, limit: int | None = None) -> list[StepRecord]:
        """The records of steps after ``step`` (oldest first; the latest ``limit`` when given)."""
        with self.lock:
            out = list(self.steps)
        i = len(out)
        while i > 0 and out[i - 1].step > step:
            i -= 1
        out = out[i:]
        return out[-limit:] if limit else out

    @property
    def latest_step(self) -> int:
        with self.lock:
            return self.steps[-1].step if self.steps else 0


class StepEvents(StepRing):
    """The latest steps of one engine, and its recently finished requests.

    Invariants: ``len(steps) <= max_steps``; ``len(finished_requests) <= max_finished``; a request
    is in ``_watched`` only while it is unfinished and was scheduled at least once; a finished
    request is summarized once.
    """

    def __init__(self, max_steps: int = DEFAULT_MAX_STEPS, max_finished: int = DEFAULT_MAX_FINISHED) -> None:
        super().__init__(max_steps)
        self.finished_requests: deque[RequestSummary] = deque(maxlen=max_finished)
        self.num_steps = 0  # steps recorded in all
        self._watched: dict[str, Request] = {}  # scheduled and not yet seen finished
        self._previous: list[Request] = []  # the previous step's requests (checked first)

    def record(self, scheduler_output: SchedulerOutput, engine: Any, duration_s: float) -> None:
        """Called by the engine once per launched step, after the scheduler's update (so each
        scheduled request's ``num_computed_tokens`` already counts this step's tokens)."""
        self.num_steps += 1
        step = self.num_steps
        scheduler = engine.scheduler
        pool = engine.kv_cache_manager.pool
        watched = self._watched
        scheduled: list[tuple[str, int, str]] = []
        requests: list[Request] = []
        prompt_tokens = output_tokens = 0
        for s in scheduler_output.scheduled_requests:
            req = s.request
            n = s.num_tokens
            start = req.num_computed_tokens - n
            n_prompt = len(req.prompt_token_ids)
            if start < n_prompt or n - len(s.draft_token_ids) > 1:
                scheduled.append((req.request_id, n, PREFILL))
                prompt_tokens += min(n, max(0, n_prompt - start))
            else:
                scheduled.append((req.request_id, n, DECODE))
            output_tokens += s.needs_sample
            requests.append(req)
            watched[req.request_id] = req
        preempted = scheduler_output.preempted
        waiting = scheduler.waiting
        num_waiting = len(waiting)
        waiting_ids = [r.request_id for r, _ in zip(waiting, range(MAX_WAITING_IDS), strict=False)]
        record = StepRecord(
            step,
            time.time(),
            duration_s,
            len(scheduled),
            scheduler_output.num_batched_tokens,
            scheduler.config.max_num_batched_tokens,
            scheduled,
            prompt_tokens,
            output_tokens,
            [r.request_id for r in preempted] if preempted else [],
            [r.request_id for r in scheduler_output.swapped_out] if scheduler_output.swapped_out else [],
            [r.request_id for r in scheduler_output.swapped_in] if scheduler_output.swapped_in else [],
            waiting_ids,
            num_waiting,
            len(scheduler.running),
            pool.num_blocks - len(pool.free_queue),
            pool.num_blocks,
            [r.request_id for r, _ in zip(scheduler.swapped, range(MAX_WAITING_IDS), strict=False)]
            if scheduler.swapped
            else [],
        )
        with self.lock:
            self.steps.append(record)
        previous, self._previous = self._previous, requests
        if step % SWEEP_EVERY == 0:
            self.collect_finished()
        else:
            self._collect(previous)

    def _collect(self, requests: list[Request]) -> None:
        """Summarize those of ``requests`` that have finished and stop watching them."""
        done = [r for r in requests if r.status.finished and r.request_id in self._watched]
        if not done:
            return
        now = time.time()
        for r in done:
            del self._watched[r.request_id]
        summaries = [summarize(r, now) for r in done]
        with self.lock:
            self.finished_requests.extend(summaries)

    def collect_finished(self) -> None:
        """Look at every watched request for an end (engine thread only: before a snapshot, and
        every SWEEP_EVERY steps, so that a request that ends outside a step is seen too)."""
        self._collect(list(self._watched.values()))

    def finished(self) -> list[RequestSummary]:
        """The latest finished requests, oldest first."""
        with self.lock:
            return list(self.finished_requests)

    @property
    def num_watched(self) -> int:
        return len(self._watched)
