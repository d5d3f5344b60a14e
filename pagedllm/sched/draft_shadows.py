"""The draft model's bookkeeping of its own KV cache (draft-model speculation; the proposer that
runs the draft is :mod:`pagedllm.worker.draft_model`).

Each target request that gets drafts has a *shadow* :class:`~pagedllm.request.Request` on the
draft's pool, whose tokens are the target request's tokens (they only ever grow) and whose
``num_computed_tokens`` counts the leading ones whose draft KV is written; after them the draft KV
also holds the draft tokens fed by the latest proposal (``DraftState.fed``). This module alone
writes the shadows (the scheduling room owns request state); it turns each draft step into a
:class:`~pagedllm.sched.scheduler.SchedulerOutput`, block-table changes included, for the draft's
model runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched.kv_cache_manager import KVCacheManager
from pagedllm.sched.scheduler import ScheduledRequest, Scheduler, SchedulerOutput

# The shadow requests' sampling: the draft's argmax, no processor.
_DRAFT_PARAMS = SamplingParams(temperature=0.0, max_tokens=None)


@dataclass
class DraftState:
    """What the draft's KV cache holds for one target request.

    Invariant (between calls): the draft KV of positions ``[0, shadow.num_computed_tokens +
    len(fed))`` is the draft's computation of ``request.all_token_ids[:shadow.num_computed_tokens]``
    followed by ``fed``, in ``shadow.block_ids`` (one reference each on the draft pool);
    ``shadow.all_token_ids`` is a prefix of ``request.all_token_ids``.
    """

    request: Request  # the target request
    shadow: Request  # its stand-in on the draft's pool
    fed: list[int] = field(default_factory=list)  # draft tokens written after the computed tokens

    def sync(self) -> int:
        """Bring the shadow's tokens up to the request's and roll the draft KV back to the longest
        prefix still valid (the fed drafts the target accepted count), leaving at least the latest
        token to compute; returns the tokens still to compute. The rolled-back positions keep their
        blocks (they are written again), so the block table does not change."""
        tokens = self.request.all_token_ids
        shadow = self.shadow
        for token in tokens[shadow.num_tokens :]:
            shadow.append_output_token(token)
        valid = shadow.num_computed_tokens
        for draft in self.fed:
            if valid >= len(tokens) or tokens[valid] != draft:
                break
            valid += 1
        shadow.num_computed_tokens = min(valid, len(tokens) - 1)
        shadow.num_pending_tokens = 0
        self.fed = []
        return len(tokens) - shadow.num_computed_tokens


class ShadowRequests:
    """The shadows of the target requests that get drafts, on the draft's own KV pool.

    Invariant: a state per running target request that got drafts since it last left ``running``;
    :meth:`sweep` frees the others' blocks.
    """

    def __init__(self, kv_cache_manager: KVCacheManager, max_model_len: int) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.states: dict[str, DraftState] = {}

    def free(self, state: DraftState) -> None:
        self.kv_cache_manager.free(state.shadow)
        state.fed = []
        del self.states[state.request.request_id]

    def sweep(self) -> None:
        """Free the state of requests that are no longer running (finished, aborted, preempted)."""
        for state in list(self.states.values()):
            if state.request.status != RequestStatus.RUNNING:
                self.free(state)

    def state_of(self, request: Request) -> DraftState:
        state = self.states.get(request.request_id)
        if state is not None and state.request is not request:  # an id reused by a new request
            self.free(state)
            state = None
        if state is None:
            shadow = Request(
                request.request_id,
                list(request.all_token_ids),
                _DRAFT_PARAMS,
                max_tokens=self.max_model_len,
                eos_token_ids=[],
            )
            shadow.status = RequestStatus.RUNNING
            state = self.states[request.request_id] = DraftState(request, shadow)
        return state

    def prepare(self, request: Request, k: int) -> tuple[DraftState, int] | None:
        """Sync the request's shadow and allocate the slots of its tokens to catch up plus ``k - 1``
        drafts: ``(state, tokens to catch up)``, or None when the draft pool has no room for them."""
        state = self.state_of(request)
        missing = state.sync()
        if not self.kv_cache_manager.allocate_slots(state.shadow, missing + k - 1):
            return None
        return state, missing

    def step(self, steps: list[ScheduledRequest]) -> SchedulerOutput:
        """One draft step's output for the draft's runner, with the block tables' changes."""
        out = SchedulerOutput(steps, sum(s.num_tokens for s in steps))
        Scheduler.attach_tables(out, self.kv_cache_manager)
        return out

    @staticmethod
    def advance(steps: list[ScheduledRequest]) -> None:
        """A draft step was launched: its tokens' KV is (being) written."""
        for s in steps:
            s.request.num_computed_tokens += s.num_tokens

    @staticmethod
    def feed(state: DraftState, position: int) -> ScheduledRequest:
        """The row of a decode step that computes draft ``position`` - 1 (read on the device, as a
        pending token) and samples draft ``position``."""
        state.shadow.num_pending_tokens = position
        return ScheduledRequest(state.shadow, 1)

    @staticmethod
    def settle(state: DraftState, tokens: list[int]) -> None:
        """After a proposal of ``tokens``: every one but the last was fed to the draft, and is
        written after the request's tokens."""
        shadow = state.shadow
        shadow.num_computed_tokens = shadow.num_tokens
        shadow.num_pending_tokens = 0
        state.fed = tokens[: len(tokens) - 1]

    def check_idle(self) -> None:
        """Free what finished requests left, then assert no request holds draft state or blocks."""
        self.sweep()
        assert not self.states, f"draft state left for {sorted(self.states)[:5]}"
        self.kv_cache_manager.check_idle()
