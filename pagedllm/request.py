"""Request state as the scheduler, KV cache manager and output processor see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import Logprob
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class GrammarState(Protocol):
    """A constrained sequence's structured-output matcher (:class:`pagedllm.structured.grammar.XGrammarState`).

    Advanced with every output token; once the grammar has matched completely, the only token it
    allows is a stop token, and accepting that token terminates it.
    """

    matcher: Any  # the xgrammar matcher, read by the batched bitmask

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar does not allow it."""
        ...

    @property
    def is_terminated(self) -> bool: ...

    @property
    def is_completed(self) -> bool: ...

    @property
    def is_active(self) -> bool:
        """Whether the grammar constrains the next token (False while it waits for its start
        marker, see :class:`GatedGrammar`): inactive rows are sampled unconstrained."""
        ...


class GatedGrammar:
    """A grammar that starts after a marker (``StructuredOutputsParams.after``).

    Until the token ids ``after`` have appeared contiguously among the tokens it is given, every token
    is accepted, the inner matcher is left untouched and ``is_active`` is False; from the token after
    the marker on it is the inner grammar. Never completed or terminated before it is active.
    """

    __slots__ = ("inner", "after", "matcher", "_recent", "_active")

    def __init__(self, inner: GrammarState, after: list[int]) -> None:
        if not after:
            raise ValueError("GatedGrammar needs a non-empty marker.")
        self.inner = inner
        self.after = list(after)
        self.matcher = inner.matcher
        self._recent: list[int] = []  # the latest len(after) tokens while inactive
        self._active = False

    def accept_token(self, token_id: int) -> bool:
        if self._active:
            return self.inner.accept_token(token_id)
        recent = self._recent
        recent.append(token_id)
        if len(recent) > len(self.after):
            del recent[0]
        self._active = recent == self.after
        return True

    @property
    def is_active(self) -> bool:
        return self._active

    @property
    def is_terminated(self) -> bool:
        return self._active and self.inner.is_terminated

    @property
    def is_completed(self) -> bool:
        return self._active and self.inner.is_completed


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"  # preempted with its KV kept in the host tier (``host_block_ids``)
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    def __init__(self, value: str) -> None:
        # A plain attribute: read for every request every step (a set lookup would hash the member).
        self.finished = value.startswith("finished")

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass
class Request:
    """One sequence being generated.

    Invariants: ``num_computed_tokens <= num_tokens + num_pending_tokens``; the KV of tokens
    ``[0, num_computed_tokens)`` is in the blocks ``block_ids`` (logical block i -> physical block
    ``block_ids[i]``); ``len(block_hashes)`` full blocks of it are registered in the prefix cache,
    all of them over known token ids.

    Who writes which field (``tests/test_layers.py`` checks that only ``sched`` and ``engine`` write
    any; every other room, the worker included, only reads). *Input*: the engine's
    ``InputProcessor`` (or beam search) builds the request; *engine*: ``LLMEngine``'s step loop;
    *outputs*: the engine's ``OutputProcessor``; *scheduler*: ``sched`` (``Scheduler``,
    ``KVCacheManager``, ``HostTier``, and ``sched/draft_shadows.py`` for the draft model's shadow
    requests, which are requests of their own).

    ============================================  =====================================================
    field                                         written by
    ============================================  =====================================================
    request_id, prompt_token_ids, params,         input, at construction only (the objects ``grammar``
    max_tokens, eos_token_ids, arrival_time,      and ``generator`` change as tokens are accepted and
    prompt, parent_id, index, bad_words_token_ids, sampled, the fields never)
    grammar, prefill_leader, generator,
    pooling_params, lora_request
    priority                                      engine (``add_request``), before scheduling
    arrival_order, status, num_cached_tokens,     scheduler
    num_preemptions, first_scheduled_time
    num_computed_tokens                           scheduler (admission, preemption, each step); engine
                                                  (takes rejected draft tokens back)
    num_pending_tokens                            engine (a launched step's token, until resolved);
                                                  scheduler (draft shadows)
    spec_token_ids                                engine (the drafts a proposer returns)
    block_ids, block_hashes, host_block_ids       scheduler (``KVCacheManager``, ``HostTier``); the
                                                  worker learns its block tables from
                                                  ``SchedulerOutput`` alone, never from these
    output_token_ids (and the token list),        outputs (``append_output_token``); scheduler (draft
                                                  shadows copy the target's tokens)
    cumulative_logprob, logprobs, stop_reason,    outputs
    first_token_time, last_token_time
    prompt_logprobs                               outputs, from the prompt logprobs a step's
                                                  ``RunnerOutput`` returns
    ============================================  =====================================================
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    eos_token_ids: list[int]
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # under the priority scheduling policy: lower values run first
    arrival_order: int = 0  # set by the scheduler: breaks ties between equal priorities
    prompt: str | None = None
    parent_id: str | None = None  # set for the n > 1 children of one prompt
    index: int = 0  # index among the parent's n sequences
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # Tokens sampled by a step still in flight (scheduled ahead): their ids are not on the host yet.
    num_pending_tokens: int = 0
    # Draft tokens proposed after the latest token (speculative decoding), verified by the next step.
    spec_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache at first schedule
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    # While swapped out: the host-tier blocks holding its KV, entry for entry as ``block_ids`` held
    # them (released entries stay released); empty otherwise.
    host_block_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: int | str | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # Structured-output matcher, advanced with every output token; wrapped in a GatedGrammar when
    # ``params.structured_outputs.after`` delays the constraint.
    grammar: GrammarState | None = None
    # For the n > 1 siblings after the first: wait until it has prefilled the shared prompt, then
    # reuse its full blocks through the prefix cache instead of prefilling again.
    prefill_leader: Request | None = field(default=None, repr=False)
    # prompt_logprobs[i] is for prompt token i (None for the first token); filled during prefill
    # (by the engine, from the model runner's step outputs).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # Set for a pooling (embedding) request: its prompt is computed whole in one step and pooled;
    # nothing is sampled (``params`` are then the defaults, read by nobody) and it finishes there.
    pooling_params: PoolingParams | None = None
    # The LoRA adapter it runs with (None: the base model).
    lora_request: LoRARequest | None = None

    def __post_init__(self) -> None:
        self._all_token_ids = list(self.prompt_token_ids)
        p = self.params
        marker = p.structured_outputs.after if p.structured_outputs is not None else None
        if self.grammar is not None and marker and not isinstance(self.grammar, GatedGrammar):
            self.grammar = GatedGrammar(self.grammar, marker)  # the constraint starts after the marker
        self._reads_no_outputs = (
            self.grammar is None
            and not self.bad_words_token_ids
            and p.repetition_penalty == 1.0
            and p.frequency_penalty == 0.0
            and p.presence_penalty == 0.0
        )
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        if self.params.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(self.params.seed + self.index)

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id (0: the base model)."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Known tokens plus those sampled by the step in flight."""
        return len(self._all_token_ids) + self.num_pending_tokens

    @property
    def reaches_length_with_pending(self) -> bool:
        """True when the tokens in flight already bring the output to ``max_tokens``."""
        return len(self.output_token_ids) + self.num_pending_tokens >= self.max_tokens

    @property
    def can_sample_ahead(self) -> bool:
        """Whether the next token may be sampled before the host has the latest one: nothing the
        sampler does for this request reads its output tokens (penalties, bad words, a grammar, a
        ``min_tokens`` not yet reached)."""
        return self._reads_no_outputs and len(self.output_token_ids) >= self.params.min_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def waits_for_leader(self) -> bool:
        """True while the sibling that prefills the shared prompt has not done so yet."""
        leader = self.prefill_leader
        if leader is None or leader.is_finished:
            return False
        return leader.num_computed_tokens < leader.num_prompt_tokens

    @property
    def uses_prefix_cache(self) -> bool:
        # Prompt logprobs need logits at every prompt position, so nothing may be skipped.
        return self.params.prompt_logprobs is None
