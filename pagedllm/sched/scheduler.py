"""Token-centric continuous-batching scheduler with preemption by recompute or by swapping."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.request import Request, RequestStatus
from pagedllm.sched.kv_cache_manager import RELEASED_BLOCK, BlockTableChange, KVCacheManager
from pagedllm.sched.preemption import PreemptionCosts
from pagedllm.sched.step_budget import StepBudget, StepShape


@dataclass
class SchedulerConfig:
    max_num_seqs: int  # most requests in ``running`` at once
    max_num_batched_tokens: int  # token budget of one step (prefill chunks and decodes together)
    # Pooling engines: a prompt is admitted whole or waits (no chunked prefill), and an encoder's
    # requests take no KV blocks.
    whole_prompts: bool = False
    uses_kv_cache: bool = True
    # Steps in flight through pipeline stages at once. Above 1, a request is in at most one of them
    # (one with a pending token waits for it) and a step takes at most ceil(unfinished / this)
    # requests, so consecutive steps hold disjoint groups of about equal size.
    interleaved_steps: int = 1
    # "fcfs", or "priority": requests in order of (priority, arrival), lower values first.
    policy: str = "fcfs"
    # How a victim is preempted: "recompute" (its KV is dropped), "swap" (its KV moves to the host
    # tier when that has room, else recompute) or "auto" (swap when ``costs`` say it is quicker).
    preemption_mode: str = "recompute"
    costs: PreemptionCosts | None = None  # needed by "auto" with a host tier
    # Step-time target in seconds (None: none): in a step with decodes, prefill chunks are sized by a
    # cost model fitted to the engine's measured steps (see pagedllm.sched.step_budget) so that the
    # step's predicted time stays under it. Not with ``whole_prompts`` nor ``interleaved_steps``
    # above 1 (token budget only).
    max_step_time_s: float | None = None
    # LoRA: the most distinct adapters among running requests (the worker's adapter slots); 0: no
    # adapters. A request whose adapter would exceed it waits (in order: nothing behind it is
    # admitted first), so it runs as soon as a running adapter's requests have all finished.
    max_loras: int = 0

    def __post_init__(self) -> None:
        if self.max_step_time_s is not None and (self.whole_prompts or self.interleaved_steps > 1):
            raise ValueError(
                "max_step_time_s applies to generation steps run one at a time (not to whole_prompts "
                "nor to interleaved_steps above 1)."
            )


@dataclass
class ScheduledRequest:
    """One row of a step: a request and the tokens it computes."""

    # The request (the worker reads its tokens, sampling parameters and counts; it writes nothing).
    request: Request
    # Tokens to compute this step, starting at request.num_computed_tokens: known tokens, then the
    # draft tokens (speculative decoding), which the step verifies.
    num_tokens: int
    # Draft tokens verified by this step (speculative decoding), after the known tokens.
    draft_token_ids: list[int] = field(default_factory=list)
    # True when this chunk reaches the end of the request's tokens (a new token is sampled).
    needs_sample: bool = field(init=False)

    def __post_init__(self) -> None:
        request = self.request
        known = self.num_tokens - len(self.draft_token_ids)
        self.needs_sample = request.num_computed_tokens + known == request.num_tokens_with_pending


@dataclass
class SchedulerOutput:
    """What the scheduler hands the worker for one step: the contract between the two rooms.

    The worker keeps a block table per request that holds device blocks and maintains it from
    ``dropped_tables`` and ``block_table_changes`` alone, applied in that order before the step's
    inputs are built (it never reads ``Request.block_ids``). Every table a scheduled request reads
    is up to date after them; the tables of running requests left out of the step stay as they were.
    """

    # The step's rows, in batch order.
    scheduled_requests: list[ScheduledRequest] = field(default_factory=list)
    # Tokens the step computes (the sum of the rows' num_tokens).
    num_batched_tokens: int = 0
    # Requests preempted while this step was scheduled (by recompute or by swapping).
    preempted: list[Request] = field(default_factory=list)
    # Blocks entered in the prefix cache by this schedule, to be computed by its forward.
    newly_cached_blocks: list[int] = field(default_factory=list)
    # Requests preempted by swapping their KV out to the host tier (a subset of ``preempted``), and
    # swapped requests brought back (they are among ``scheduled_requests``).
    swapped_out: list[Request] = field(default_factory=list)
    swapped_in: list[Request] = field(default_factory=list)
    # KV block copies made before the step's forward, all device -> host ones first:
    # (device block, host block) to the host tier, then (host block, device block) back.
    copies_out: list[tuple[int, int]] = field(default_factory=list)
    copies_in: list[tuple[int, int]] = field(default_factory=list)
    # Requests whose block tables the worker drops, applied first: they finished, were aborted or
    # preempted (recompute or swap out) since the worker's previous step. An id may come back in
    # ``block_table_changes`` of the same step (readmitted, or a new request reusing the id).
    dropped_tables: list[str] = field(default_factory=list)
    # Block-table changes of the scheduled requests, applied after ``dropped_tables``: blocks
    # appended since the previous step (new prompt chunks, a decode crossing a block boundary), or a
    # whole table (first schedule, with any prefix-cache hits; readmission after preemption; swap
    # in). Entries released from a sliding window keep their old ids (never read); rejected draft
    # tokens (speculative decoding) keep their slots and change nothing.
    block_table_changes: list[BlockTableChange] = field(default_factory=list)
    # What the step computes (its rows, tokens, attention pairs and prefill tokens), for the step-time
    # cost model.
    shape: StepShape = field(default_factory=StepShape)
    scheduled_at: float = field(default_factory=time.perf_counter)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_requests

    @property
    def sample_rows(self) -> list[int]:
        """Indices into ``scheduled_requests`` of the rows that sample a token."""
        return [i for i, s in enumerate(self.scheduled_requests) if s.needs_sample]


class Scheduler:
    """Decides, every step, which requests run and how many tokens each computes.

    Queues: ``waiting``, ``running`` and ``swapped``, each in the policy's order. FCFS: ``waiting``
    by arrival (preempted requests re-enter at its front), ``running`` by admission (the newest last),
    ``swapped`` by arrival. Priority: all by ``(priority, arrival)``, lower priority values first. A
    request is in at most one queue; finished and aborted requests are in none and hold no blocks.
    Only ``running`` requests hold device blocks; only ``swapped`` ones hold host-tier blocks. With
    LoRA (``max_loras`` > 0), ``running`` holds requests of at most ``max_loras`` distinct adapters.

    Each step: running decodes first (1 token each), then running requests' unfinished prefills
    continue in chunks, then waiting requests fill the remaining token budget, under
    ``max_num_seqs``. With ``max_step_time_s``, a :class:`StepBudget` also bounds every prefill
    chunk of a step that has decodes, so that the step's predicted time stays under the target (the
    step's first chunk gets at least one block; decodes are never held back by it). When
    blocks run out, the last running request (the newest; under priority, the least urgent) is
    preempted: by recompute, its blocks are freed and it goes back to ``waiting`` (its cached full
    blocks usually survive); by swapping, its KV moves to the host tier and it goes to ``swapped``,
    from where it comes back, ahead of waiting requests, as soon as the device has blocks for it (in
    a step that preempted nothing, so no step both swaps out and in). Under priority, waiting requests more urgent than the least urgent
    running one are admitted before the running requests are scheduled, preempting less urgent
    running requests when there is no room (blocks or ``max_num_seqs``) for them.

    Scheduling ahead: a request may hold ``num_pending_tokens`` sampled by a step still in flight.
    A running one then decodes its pending token (the model runner takes its id from the device),
    unless those tokens already reach ``max_tokens``; a waiting one (preempted while in flight) is
    not admitted until its pending token has reached the host. With ``interleaved_steps`` above 1
    (pipeline stages, each on a different step) a running request with a pending token is skipped
    instead: the stage that embeds its next token runs before that token is sampled.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self._arrivals = itertools.count()  # arrival order, which breaks ties between priorities
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.step_budget: StepBudget | None = None
        if config.max_step_time_s is not None:
            self.step_budget = StepBudget(config.max_step_time_s, kv_cache_manager.block_size)
        # The decode rows the running requests will take this step, reserved before step 0 admits
        # prefills ahead of them (priority); empty once the decodes are scheduled.
        self._reserved = StepShape()
        self._last_step_done = 0.0  # time.perf_counter() when the latest step's outputs were out

    # -- queue management -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        request.arrival_order = next(self._arrivals)
        self._insert(self.waiting, request)

    def _insert(
        self, queue: deque[Request] | list[Request], request: Request, by_arrival: bool = False
    ) -> None:
        """Append ``request`` (FCFS), or insert it after every request of its priority or a more
        urgent one (priority: the queue stays ordered by ``(priority, arrival)``); ``by_arrival``
        keeps an FCFS queue in arrival order too."""
        priority = self.config.policy == "priority"
        if not priority and not by_arrival:
            queue.append(request)
            return

        def key(r: Request) -> tuple[int, int]:
            return (r.priority if priority else 0, r.arrival_order)

        at = len(queue)
        while at > 0 and key(queue[at - 1]) > key(request):
            at -= 1
        queue.insert(at, request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Remove a request from its queue and free its blocks at once."""
        assert status.finished
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        request.status = status
        self.kv_cache_manager.free(request)
        self.requests.pop(request.request_id, None)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        aborted = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None and not request.is_finished:
                self.finish_request(request, RequestStatus.FINISHED_ABORTED)
                aborted.append(request)
        return aborted

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(request)
        if self._swaps(request) and self.kv_cache_manager.swap_out(request):
            request.status = RequestStatus.SWAPPED
            self._insert(self.swapped, request, by_arrival=True)
            out.swapped_out.append(request)
            return
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        if self.config.policy == "priority":
            self._insert(self.waiting, request)
        else:
            self.waiting.appendleft(request)

    def _swaps(self, request: Request) -> bool:
        """Whether the preemption mode swaps this victim out (rather than recomputing it later)."""
        mode = self.config.preemption_mode
        if mode == "recompute" or self.kv_cache_manager.host is None or not request.num_computed_tokens:
            return False
        if mode == "swap" or self.config.costs is None:
            return True
        held = sum(1 for b in request.block_ids if b != RELEASED_BLOCK)
        return self.config.costs.prefers_swap(held, request.num_computed_tokens)

    # -- the step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        groups = self.config.interleaved_steps
        most = -(-(len(self.running) + len(self.waiting) + len(self.swapped)) // groups)  # in this step
        scheduled: set[str] = set()

        # 0. Priority: waiting requests more urgent than the least urgent running one come first, and
        #    may preempt less urgent running requests to get in.
        if self.config.policy == "priority":
            if self.step_budget is not None:
                self._reserved = self._decode_reservation()
            idx = 0
            while idx < len(self.waiting) and budget > 0 and len(out.scheduled_requests) < most:
                request = self.waiting[idx]
                if self.running and request.priority >= self.running[-1].priority:
                    break  # no running request is less urgent: the usual admission below
                if request.waits_for_leader or request.num_pending_tokens:
                    idx += 1
                    continue
                num_new = self._admit(out, idx, budget)
                while num_new is None and self.running and self.running[-1].priority > request.priority:
                    self._preempt(self.running[-1], out)
                    num_new = self._admit(out, idx, budget)
                if num_new is None:
                    break
                scheduled.add(request.request_id)
                budget -= num_new

        self._reserved = StepShape()

        # 1. Running requests, in the policy's order: their decodes, then their unfinished prefills.
        budget = self._schedule_running(out, budget, most, scheduled, prefills=False)
        budget = self._schedule_running(out, budget, most, scheduled, prefills=True)

        # 2. Swapped requests come back first, then waiting requests fill the rest (not in a step that
        #    had to preempt, nor while a swapped request waits for room).
        blocked = False
        if not out.preempted and self.swapped:
            budget, blocked = self._swap_in(out, budget, most)
        if not out.preempted and not blocked:
            idx = 0
            while idx < len(self.waiting) and budget > 0 and len(out.scheduled_requests) < most:
                request = self.waiting[idx]
                if request.waits_for_leader or request.num_pending_tokens:
                    idx += 1
                    continue
                num_new = self._admit(out, idx, budget)
                if num_new is None:
                    break
                budget -= num_new

        if any(s.draft_token_ids for s in out.scheduled_requests) and any(
            s.num_tokens > 1 + len(s.draft_token_ids) for s in out.scheduled_requests
        ):
            budget += self._drop_drafts(out)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        out.copies_out, out.copies_in = self.kv_cache_manager.take_copies()
        if out.scheduled_requests:  # else the worker hears of them with the next step it runs
            self.attach_tables(out, self.kv_cache_manager)
        return out

    def _schedule_running(
        self, out: SchedulerOutput, budget: int, most: int, scheduled: set[str], prefills: bool
    ) -> int:
        """Schedule the running requests' decodes (``prefills`` False: rows of one token, with their
        drafts when there is room) or their unfinished prefills (True: chunks), in ``running``'s
        order, preempting the last running request not yet scheduled when blocks run out; returns
        the token budget left."""
        groups = self.config.interleaved_steps
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled_requests) < most:
            request = self.running[i]
            remaining = request.num_tokens_with_pending - request.num_computed_tokens
            pending = request.num_pending_tokens
            if (
                remaining <= 0
                or (remaining > 1) != prefills
                or request.request_id in scheduled
                or (pending and (groups > 1 or request.reaches_length_with_pending))
            ):
                i += 1
                continue
            num_new = self._chunk(out, request.num_computed_tokens, remaining, budget) if prefills else 1
            if num_new <= 0:
                i += 1  # no room in this step's time for more prefill
                continue
            # A decode may also verify the request's draft tokens, when there is room for them.
            drafts = request.spec_token_ids[: budget - 1] if not prefills and not pending else []
            if drafts and self.kv_cache_manager.allocate_slots(request, 1 + len(drafts)):
                num_new += len(drafts)
            elif not self._make_room(out, request, num_new, scheduled):
                continue  # the current request was preempted; the list shifted, do not advance i
            else:
                drafts = []
            self._schedule(out, request, num_new, drafts)
            scheduled.add(request.request_id)
            budget -= num_new
            i += 1
        return budget

    def _make_room(self, out: SchedulerOutput, request: Request, num_new: int, scheduled: set[str]) -> bool:
        """Allocate slots for ``num_new`` tokens of a running request, preempting the last running
        request not yet scheduled this step (one after it in ``running``, or itself) until they fit;
        returns False when the request itself was preempted."""
        while self.config.uses_kv_cache and not self.kv_cache_manager.allocate_slots(request, num_new):
            victim = next(r for r in reversed(self.running) if r.request_id not in scheduled)
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _chunk(self, out: SchedulerOutput, start: int, remaining: int, budget: int) -> int:
        """The prompt tokens a request at position ``start`` with ``remaining`` to compute gets this
        step: all that the token budget allows, and within the step-time target when there is one
        and the step has decodes (a step of prompts alone keeps no stream waiting)."""
        shape = out.shape + self._reserved
        if self.step_budget is None or shape.rows == shape.prefill_rows:
            return min(remaining, budget)
        return self.step_budget.chunk_limit(shape, start, remaining, budget)

    def _decode_reservation(self) -> StepShape:
        """The rows of the running requests that will decode this step (see ``_schedule_running``)."""
        shape = StepShape()
        for request in self.running:
            remaining = request.num_tokens_with_pending - request.num_computed_tokens
            pending = request.num_pending_tokens
            if remaining == 1 and not (
                pending and (self.config.interleaved_steps > 1 or request.reaches_length_with_pending)
            ):
                shape = shape.plus(request.num_computed_tokens, 1)
        return shape

    def _swap_in(self, out: SchedulerOutput, budget: int, most: int) -> tuple[int, bool]:
        """Bring swapped requests back, in order, while there is room; returns the budget left and
        whether one is left waiting for room (one whose token is in flight waits for that instead)."""
        idx = 0
        while idx < len(self.swapped):
            request = self.swapped[idx]
            if request.num_pending_tokens:
                idx += 1
                continue
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = (
                self._chunk(out, request.num_computed_tokens, remaining, budget)
                if remaining > 1
                else min(remaining, budget)
            )
            if (
                num_new <= 0
                or len(out.scheduled_requests) >= most
                or len(self.running) >= self.config.max_num_seqs
                or not self._adapter_fits(request)
                or not self.kv_cache_manager.swap_in(request, num_new)
            ):
                return budget, True
            del self.swapped[idx]
            request.status = RequestStatus.RUNNING
            self._insert(self.running, request)
            self._schedule(out, request, num_new)
            out.swapped_in.append(request)
            budget -= num_new
        return budget, False

    @staticmethod
    def _drop_drafts(out: SchedulerOutput) -> int:
        """Verify no drafts in a step that also computes prompt tokens: drafts are verified in decode
        steps only, whose rows are computed exactly as plain decoding computes them. Returns the
        tokens given back (their slots stay allocated, for the tokens to come)."""
        freed = 0
        out.shape = StepShape()
        for s in out.scheduled_requests:
            freed += len(s.draft_token_ids)
            s.num_tokens -= len(s.draft_token_ids)
            s.draft_token_ids = []
            out.shape = out.shape.plus(s.request.num_computed_tokens, s.num_tokens)
        return freed

    def _admit(self, out: SchedulerOutput, idx: int, budget: int) -> int | None:
        """Move ``waiting[idx]`` to ``running`` and schedule up to ``budget`` of its tokens (after its
        cached prefix); returns how many, or None (nothing changed) when there is no room for it:
        ``max_num_seqs`` running, too few free blocks, or too little budget for a whole prompt."""
        request = self.waiting[idx]
        if len(self.running) >= self.config.max_num_seqs or not self._adapter_fits(request):
            return None
        computed, num_cached = self.kv_cache_manager.get_computed_blocks(request)
        num_new = self._chunk(out, num_cached, request.num_tokens - num_cached, budget)
        if num_new <= 0:
            return None  # no room in this step's time for more prefill
        if self.config.whole_prompts and num_new < request.num_tokens - num_cached:
            return None  # the rest of the prompt waits for a step with room for all of it
        if self.config.uses_kv_cache and not self.kv_cache_manager.allocate_slots(request, num_new, computed):
            return None
        del self.waiting[idx]
        request.num_computed_tokens = num_cached
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
            self.kv_cache_manager.record_prefix_lookup(request.num_tokens, num_cached)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        request.status = RequestStatus.RUNNING
        self._insert(self.running, request)
        self._schedule(out, request, num_new)
        return num_new

    def _adapter_fits(self, request: Request) -> bool:
        """Whether ``request`` may join ``running`` without more than ``max_loras`` distinct adapters."""
        lid = request.lora_int_id
        if not lid or not self.config.max_loras:
            return True
        running = {r.lora_int_id for r in self.running if r.lora_int_id}
        return lid in running or len(running) < self.config.max_loras

    def _schedule(
        self, out: SchedulerOutput, request: Request, num_tokens: int, drafts: list[int] | None = None
    ) -> None:
        out.scheduled_requests.append(ScheduledRequest(request, num_tokens, drafts or []))
        out.shape = out.shape.plus(request.num_computed_tokens, num_tokens, len(drafts or []))
        # Blocks this step fills are shared from now on (see KVCacheManager.cache_full_blocks); a
        # block ending in a pending token is registered by a later step, once its ids are known.
        known = min(request.num_computed_tokens + num_tokens, request.num_tokens)
        out.newly_cached_blocks += self.kv_cache_manager.cache_full_blocks(request, known)

    @staticmethod
    def attach_tables(out: SchedulerOutput, kv_cache_manager: KVCacheManager) -> None:
        """Fill ``out``'s block-table fields from ``kv_cache_manager`` (whose blocks the step's
        requests hold): the tables to drop, then the changes of the scheduled requests' tables."""
        out.dropped_tables = kv_cache_manager.take_dropped_tables()
        out.block_table_changes = kv_cache_manager.table_changes(s.request for s in out.scheduled_requests)

    def step_done(self, out: SchedulerOutput) -> None:
        """A step's outputs are out: feed its time, as its requests' streams saw it, to the step-time
        cost model (when there is a target): from its scheduling, or from the previous step's end
        when it was scheduled before that (steps in flight), to now."""
        now = time.perf_counter()
        if self.step_budget is not None:
            self.step_budget.observe(out.shape, now - max(out.scheduled_at, self._last_step_done))
        self._last_step_done = now

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance computed-token counts after the step's forward ran (draft tokens included: the
        engine takes the rejected ones back once they are verified)."""
        for scheduled in out.scheduled_requests:
            scheduled.request.num_computed_tokens += scheduled.num_tokens


def plan_micro_batches(query_lens: list[int], count: int) -> list[tuple[int, int]]:
    """Cut a step's requests (their query lengths, in batch order) into at most ``count`` runs of
    consecutive requests with about equal token counts: ``[(start, stop), ...]`` covering every
    request once, none empty. Pipeline stages work on different runs at once."""
    total, n = sum(query_lens), len(query_lens)
    count = max(1, min(count, n))
    bounds: list[tuple[int, int]] = []
    start = seen = 0
    for i, length in enumerate(query_lens):
        seen += length
        left = count - len(bounds) - 1  # runs still to open after this one
        if left > 0 and seen * count >= total * (len(bounds) + 1) and n - (i + 1) >= left:
            bounds.append((start, i + 1))
            start = i + 1
    bounds.append((start, n))
    return bounds
