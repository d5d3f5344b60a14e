"""Output deltas: what a core sends of each step's outputs, and how a front-end adds them up.

An engine's outputs are cumulative (a :class:`~pagedllm.outputs.RequestOutput` holds everything so
far). Between processes only what is new travels: :class:`DeltaEncoder` (in the core) remembers how
much of each sequence it has sent and makes ``RequestDelta`` messages; :class:`DeltaAccumulator` (in
the front-end) appends them and gives back cumulative outputs equal to the core's. Timestamps move
from the core's clock to the front-end's by ``offset`` seconds.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.engine.core_protocol import CompletionDelta, RequestDelta
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


class DeltaEncoder:
    """Turns the engine's cumulative outputs into deltas, remembering what each request was sent."""

    def __init__(self) -> None:
        # request id -> per sequence index: (token ids, text chars, logprobs) sent; prompt logprobs sent.
        self.sent: dict[str, tuple[dict[int, list[int]], list[bool]]] = {}

    def forget(self, request_id: str) -> None:
        self.sent.pop(request_id, None)

    def delta(self, out: RequestOutput) -> RequestDelta:
        state = self.sent.get(out.request_id)
        if state is None:
            state = self.sent[out.request_id] = ({}, [False])
        counts, prompt_sent = state
        completions = []
        for c in out.outputs:
            n_tok, n_text, n_lp = counts.get(c.index) or (0, 0, 0)
            logprobs = c.logprobs[n_lp:] if c.logprobs is not None else None
            completions.append(
                CompletionDelta(
                    index=c.index,
                    text=c.text[n_text:],
                    token_ids=c.token_ids[n_tok:],
                    logprobs=logprobs,
                    cumulative_logprob=c.cumulative_logprob,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
            counts[c.index] = [
                len(c.token_ids),
                len(c.text),
                len(c.logprobs) if c.logprobs is not None else 0,
            ]
        prompt_logprobs = None
        if out.prompt_logprobs is not None and not prompt_sent[0]:
            prompt_logprobs = out.prompt_logprobs
            prompt_sent[0] = True
        if out.finished:
            del self.sent[out.request_id]
        return RequestDelta(
            request_id=out.request_id,
            finished=out.finished,
            num_cached_tokens=out.num_cached_tokens,
            completions=completions,
            prompt_logprobs=prompt_logprobs,
            times=metrics_times(out.metrics),
        )


Times = tuple[float | None, float | None, float | None, float | None, float | None]


def metrics_times(m: RequestMetrics | None) -> Times | None:
    if m is None:
        return None
    return (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time)


class DeltaAccumulator:
    """The cumulative state of one request, rebuilt from deltas (I/O thread only)."""

    __slots__ = (
        "request_id",
        "prompt",
        "prompt_ids",
        "texts",
        "tokens",
        "logprobs",
        "cum",
        "finish",
        "stop",
        "prompt_logprobs",
        "n",
    )

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], n: int) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.n = n
        self.texts = [""] * n
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[dict[int, Logprob]] | None] = [None] * n
        self.cum: list[float | None] = [None] * n
        self.finish: list[str | None] = [None] * n
        self.stop: list[int | str | None] = [None] * n
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def apply(self, delta: RequestDelta, offset: float) -> RequestOutput:
        for c in delta.completions:
            i = c.index
            if c.text:
                self.texts[i] += c.text
            if c.token_ids:
                self.tokens[i].extend(c.token_ids)
            if c.logprobs is not None:
                if self.logprobs[i] is None:
                    self.logprobs[i] = []
                self.logprobs[i].extend(c.logprobs)  # type: ignore[union-attr]
            self.cum[i] = c.cumulative_logprob
            self.finish[i] = c.finish_reason
            self.stop[i] = c.stop_reason
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        outputs = [
            CompletionOutput(
                index=i,
                text=self.texts[i],
                token_ids=list(self.tokens[i]),
                cumulative_logprob=self.cum[i],
                logprobs=list(lp) if (lp := self.logprobs[i]) is not None else None,
                finish_reason=self.finish[i],
                stop_reason=self.stop[i],
            )
            for i in range(self.n)
        ]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_ids,
            outputs=outputs,
            finished=delta.finished,
            num_cached_tokens=delta.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
            metrics=metrics_from_times(delta.times, offset),
        )


def metrics_from_times(times: Sequence[float | None] | None, offset: float) -> RequestMetrics | None:
    """Request timings moved from the core's clock to this process's."""
    if times is None or times[0] is None:
        return None
    a, s, f, last, done = (t + offset if t is not None else None for t in times)
    assert a is not None
    return RequestMetrics(a, s, f, last, done)


__all__ = ["DeltaAccumulator", "DeltaEncoder", "Times", "metrics_from_times", "metrics_times"]
