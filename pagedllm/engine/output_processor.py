"""Turns sampled tokens into request outputs: detokenization, stop checks, n > 1 aggregation."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import RequestOutputKind


@dataclass
class SequenceState:
    """Text state of one generated sequence.

    A sequence whose text nobody reads before it finishes (``FINAL_ONLY`` output, no stop strings, no
    grammar) is ``deferred``: its tokens are detokenized in one call when its output is built.
    ``num_text_tokens`` of its output tokens make its text (not a final EOS or stop token id), the
    first ``num_decoded`` of them are in ``text``.

    For ``DELTA`` output, ``sent_text``, ``sent_tokens`` and ``sent_logprobs`` count what earlier
    outputs carried, and ``sent_finish`` whether one carried the finish. The visible text only grows
    (a stop string cuts the text at or after what was visible, see :meth:`visible_text`), so what
    was sent is never taken back.
    """

    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""
    max_stop_len: int = 0
    deferred: bool = False
    num_text_tokens: int = 0
    num_decoded: int = 0
    sent_text: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    sent_finish: bool = False

    def flush_text(self) -> None:
        """Detokenize the deferred tokens (in one call the first time, as one usually suffices)."""
        if self.num_text_tokens > self.num_decoded:
            ids = self.request.output_token_ids[self.num_decoded : self.num_text_tokens]
            detok = self.detokenizer
            self.text += detok.decode_tokens(ids) if not self.num_decoded else "".join(map(detok.step, ids))
            self.num_decoded = self.num_text_tokens

    def visible_text(self) -> str:
        """The text so far, holding back a possible partial stop string while unfinished."""
        req = self.request
        if req.is_finished or self.max_stop_len <= 1 or req.params.include_stop_str_in_output:
            return self.text
        hold = self.max_stop_len - 1
        return self.text[:-hold] if len(self.text) > hold else ""

    def completion(self) -> CompletionOutput:
        if self.deferred:
            self.flush_text()
        req = self.request
        reason = req.status.finish_reason if req.is_finished else None
        return CompletionOutput(
            index=req.index,
            text=self.visible_text(),
            token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob if req.params.logprobs is not None else None,
            logprobs=req.logprobs,
            finish_reason=reason,
            stop_reason=req.stop_reason,
        )

    def completion_delta(self) -> CompletionOutput | None:
        """What the sequence gained since the previous delta (None when nothing: no new token,
        text or finish)."""
        req = self.request
        finished = req.is_finished
        text = self.visible_text()
        tokens = req.output_token_ids
        if len(tokens) == self.sent_tokens and len(text) == self.sent_text and finished == self.sent_finish:
            return None
        assert len(text) >= self.sent_text, "visible text was taken back"
        logprobs = None
        if req.logprobs is not None:
            logprobs = req.logprobs[self.sent_logprobs :]
            self.sent_logprobs = len(req.logprobs)
        out = CompletionOutput(
            index=req.index,
            text=text[self.sent_text :],
            token_ids=tokens[self.sent_tokens :],
            cumulative_logprob=req.cumulative_logprob if req.params.logprobs is not None else None,
            logprobs=logprobs,
            finish_reason=req.status.finish_reason if finished else None,
            stop_reason=req.stop_reason if finished else None,
        )
        self.sent_text, self.sent_tokens, self.sent_finish = len(text), len(tokens), finished
        return out


@dataclass
class ParentState:
    """A user request: one prompt and its ``n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float
    children: list[SequenceState] = field(default_factory=list)
    final_only: bool = False  # RequestOutputKind.FINAL_ONLY: no snapshots before the final one
    delta: bool = False  # RequestOutputKind.DELTA: each output holds what is new since the previous
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(c.request.is_finished for c in self.children)

    def output(self) -> RequestOutput:
        """A snapshot of the request, or with ``delta`` what is new since the previous one (called for
        every request that got a token, every step)."""
        children = self.children
        first = children[0].request
        finished = self.finished
        prompt_logprobs = first.prompt_logprobs
        if self.delta:
            # The sequences that gained something, in index order.
            outputs = [d for c in children if (d := c.completion_delta()) is not None]
            if len(outputs) > 1:
                outputs.sort(key=lambda o: o.index)
            if self.prompt_logprobs_sent:
                prompt_logprobs = None
            self.prompt_logprobs_sent = True
        elif len(children) == 1:
            outputs = [children[0].completion()]
        else:
            outputs = sorted((c.completion() for c in children), key=lambda o: o.index)
        first_token_time, last_token_time = self._token_times()
        metrics = RequestMetrics(
            arrival_time=self.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=first_token_time,
            last_token_time=last_token_time,
            finished_time=time.monotonic() if finished else None,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            prompt_logprobs=prompt_logprobs,
            metrics=metrics,
        )

    def _token_times(self) -> tuple[float | None, float | None]:
        """The first token time of the request's sequences, and their latest token time."""
        reqs = [c.request for c in self.children]
        if len(reqs) == 1:
            return reqs[0].first_token_time, reqs[0].last_token_time
        first = min((r.first_token_time for r in reqs if r.first_token_time), default=None)
        last = max((r.last_token_time for r in reqs if r.last_token_time), default=None)
        return first, last


class OutputProcessor:
    """Per-request text state. ``token_intervals`` holds, for every token a sequence got after its
    first, the seconds since its previous token (at most the latest ``MAX_TOKEN_INTERVALS``; whoever
    reports latencies drains it). ``num_prompt_tokens`` totals the prompts of the requests that got
    their first token (once per request, whatever its ``n``; see :meth:`count_prompt`), and
    ``num_cached_prompt_tokens`` the part of them found in the prefix cache."""

    MAX_TOKEN_INTERVALS = 1 << 16

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.parents: dict[str, ParentState] = {}
        self.sequences: dict[str, SequenceState] = {}
        self.token_intervals: deque[float] = deque(maxlen=self.MAX_TOKEN_INTERVALS)
        self.num_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0

    def count_prompt(self, req: Request) -> None:
        """Count a request's prompt, all of it, and the part served from the prefix cache when it
        was first scheduled (vLLM's ``prompt_tokens_total`` and ``prompt_tokens_cached_total``)."""
        self.num_prompt_tokens += req.num_prompt_tokens
        self.num_cached_prompt_tokens += max(req.num_cached_tokens, 0)

    @staticmethod
    def add_prompt_logprobs(req: Request, first: int, entries: list[dict[int, Logprob] | None]) -> None:
        """Append a step's prompt logprobs (``entries[j]``: for prompt token ``first + j + 1``) to the
        request's, which its outputs carry. The runner reports each position once, in order, so
        ``first`` is the position after the last one reported."""
        assert req.prompt_logprobs is not None
        req.prompt_logprobs.extend(entries)

    def add_request(self, parent_id: str, prompt: str | None, children: list[Request]) -> None:
        first = children[0]
        parent = ParentState(
            parent_id,
            prompt,
            first.prompt_token_ids,
            first.arrival_time,
            final_only=first.params.output_kind is RequestOutputKind.FINAL_ONLY,
            delta=first.params.output_kind is RequestOutputKind.DELTA,
        )
        for req in children:
            stops = req.params.stop or []
            seq = SequenceState(
                request=req,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, req.prompt_token_ids, req.params.skip_special_tokens
                ),
                max_stop_len=max((len(s) for s in stops), default=0),
                deferred=parent.final_only and not stops and req.grammar is None,
            )
            parent.children.append(seq)
            self.sequences[req.request_id] = seq
        self.parents[parent_id] = parent

    def remove(self, parent_id: str) -> list[str]:
        """Forget a request; returns its sequences' ids."""
        parent = self.parents.pop(parent_id, None)
        if parent is None:
            return []
        ids = [c.request.request_id for c in parent.children]
        for rid in ids:
            self.sequences.pop(rid, None)
        return ids

    def child_ids(self, parent_id: str) -> list[str]:
        parent = self.parents.get(parent_id)
        return [c.request.request_id for c in parent.children] if parent else []

    def process_token(
        self,
        req: Request,
        token_id: int,
        logprob: float,
        top: dict[int, Logprob] | None,
        now: float,
    ) -> RequestStatus | None:
        """Append a sampled token (sampled at ``now``, by ``time.monotonic``); returns the finishing
        status if the sequence is done."""
        if req.first_token_time is None and req.index == 0:
            self.count_prompt(req)  # its prefill is done: the request's prompt counts, once
        grammar = req.grammar
        if token_id < 0 or (grammar is not None and not grammar.accept_token(token_id)):
            # The request's constraints (allowed ids, bad words, min_tokens, a grammar) left no token
            # to sample (the sampler's NO_TOKEN), or masked every token its grammar allows: nothing is
            # appended and the sequence ends, complete ("stop") or not ("abort").
            req.stop_reason = None
            complete = grammar is not None and grammar.is_completed
            return RequestStatus.FINISHED_STOPPED if complete else RequestStatus.FINISHED_ABORTED
        if req.first_token_time is None:
            req.first_token_time = now
        elif req.last_token_time is not None:
            self.token_intervals.append(now - req.last_token_time)
        req.last_token_time = now
        req.append_output_token(token_id)
        req.cumulative_logprob += logprob
        if req.logprobs is not None and top is not None:
            req.logprobs.append(top)
        seq = self.sequences[req.request_id]
        params = req.params
        n_out = req.num_output_tokens
        min_ok = n_out >= params.min_tokens

        if min_ok and not params.ignore_eos and token_id in req.eos_token_ids:
            req.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if min_ok and token_id in (params.stop_token_ids or ()):
            req.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if grammar is not None and grammar.is_terminated:
            req.stop_reason = None
            return RequestStatus.FINISHED_STOPPED

        if seq.deferred:
            seq.num_text_tokens = n_out
        elif delta := seq.detokenizer.step(token_id):
            old_len = len(seq.text)
            seq.text += delta
            if min_ok and params.stop:
                hit = _find_stop(seq.text, params.stop, old_len)
                if hit is not None:
                    idx, stop = hit
                    end = idx + len(stop) if params.include_stop_str_in_output else idx
                    seq.text = seq.text[:end]
                    req.stop_reason = stop
                    return RequestStatus.FINISHED_STOPPED
        if n_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


def _find_stop(text: str, stops: Iterable[str], old_len: int) -> tuple[int, str] | None:
    """The earliest stop string that ends in the new text ``text[old_len:]``, with its index.

    Each stop string is looked for from its own length before the new text, so an occurrence that
    ended in earlier text (before ``min_tokens`` allowed stopping) is never found later.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, max(0, old_len - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best
