"""Delta outputs: how they travel between processes, and how they add up to cumulative outputs.

A request streamed to its caller runs with :attr:`~pagedllm.sampling_params.RequestOutputKind.DELTA`
output: the output processor gives, every step, only what each sequence gained. Between processes the
engine core sends those outputs as they are (:func:`encode_output`; a ``FINAL_ONLY`` output, the only
one of its request, travels the same way), and the front-end turns each message back into a
:class:`~pagedllm.outputs.RequestOutput` (:func:`decode_output`). Callers that want cumulative outputs
get them from one :class:`OutputAccumulator`; a caller that fell behind gets its queued deltas merged
into one (:func:`merge_deltas`). Timestamps move from the core's clock to the front-end's by
``offset`` seconds.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.engine.core_protocol import CompletionDelta, RequestDelta
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

Times = tuple[float | None, float | None, float | None, float | None, float | None]


def metrics_times(m: RequestMetrics | None) -> Times | None:
    if m is None:
        return None
    return (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time)


def metrics_from_times(times: Sequence[float | None] | None, offset: float) -> RequestMetrics | None:
    """Request timings moved from the core's clock to this process's."""
    if times is None or times[0] is None:
        return None
    a, s, f, last, done = (t + offset if t is not None else None for t in times)
    assert a is not None
    return RequestMetrics(a, s, f, last, done)


def encode_output(out: RequestOutput) -> RequestDelta:
    """The message of a ``DELTA`` (or ``FINAL_ONLY``) output: its fields as they are."""
    return RequestDelta(
        request_id=out.request_id,
        finished=out.finished,
        num_cached_tokens=out.num_cached_tokens,
        completions=[
            CompletionDelta(
                index=c.index,
                text=c.text,
                token_ids=c.token_ids,
                logprobs=c.logprobs,
                cumulative_logprob=c.cumulative_logprob,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in out.outputs
        ],
        prompt_logprobs=out.prompt_logprobs,
        times=metrics_times(out.metrics),
    )


def decode_output(
    delta: RequestDelta, prompt: str | None, prompt_ids: list[int], offset: float
) -> RequestOutput:
    """The output a message carries, for the request of ``prompt`` and ``prompt_ids``."""
    return RequestOutput(
        request_id=delta.request_id,
        prompt=prompt,
        prompt_token_ids=prompt_ids,
        outputs=[
            CompletionOutput(
                index=c.index,
                text=c.text,
                token_ids=c.token_ids,
                cumulative_logprob=c.cumulative_logprob,
                logprobs=c.logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in delta.completions
        ],
        finished=delta.finished,
        num_cached_tokens=delta.num_cached_tokens,
        prompt_logprobs=delta.prompt_logprobs,
        metrics=metrics_from_times(delta.times, offset),
    )


class OutputAccumulator:
    """The cumulative outputs of one request of ``n`` sequences, from its delta outputs in order.

    Each cumulative output lists every sequence (one that has no token yet with empty text), owns its
    lists, and carries the prompt logprobs once they came.
    """

    __slots__ = ("texts", "tokens", "logprobs", "cum", "finish", "stop", "prompt_logprobs")

    def __init__(self, n: int) -> None:
        self.texts = [""] * n
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[dict[int, Logprob]] | None] = [None] * n
        self.cum: list[float | None] = [None] * n
        self.finish: list[str | None] = [None] * n
        self.stop: list[int | str | None] = [None] * n
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def add(self, delta: RequestOutput) -> RequestOutput:
        """Append ``delta``; returns the request's cumulative output so far."""
        for c in delta.outputs:
            i = c.index
            if c.text:
                self.texts[i] += c.text
            if c.token_ids:
                self.tokens[i].extend(c.token_ids)
            if c.logprobs is not None:
                logprobs = self.logprobs[i]
                if logprobs is None:
                    logprobs = self.logprobs[i] = []
                logprobs.extend(c.logprobs)
            self.cum[i] = c.cumulative_logprob
            self.finish[i] = c.finish_reason
            self.stop[i] = c.stop_reason
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        return RequestOutput(
            request_id=delta.request_id,
            prompt=delta.prompt,
            prompt_token_ids=delta.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=i,
                    text=self.texts[i],
                    token_ids=list(self.tokens[i]),
                    cumulative_logprob=self.cum[i],
                    logprobs=list(lp) if (lp := self.logprobs[i]) is not None else None,
                    finish_reason=self.finish[i],
                    stop_reason=self.stop[i],
                )
                for i in range(len(self.texts))
            ],
            finished=delta.finished,
            num_cached_tokens=delta.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
            metrics=delta.metrics,
        )


class OutputDecoder:
    """The outputs of one request on the front-end, from the core's messages: the deltas as they
    are, or added up by ``accumulator`` for a caller that wants cumulative outputs."""

    __slots__ = ("prompt", "prompt_ids", "accumulator")

    def __init__(
        self, prompt: str | None, prompt_ids: list[int], accumulator: OutputAccumulator | None
    ) -> None:
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.accumulator = accumulator

    def output(self, delta: RequestDelta, offset: float) -> RequestOutput:
        out = decode_output(delta, self.prompt, self.prompt_ids, offset)
        return self.accumulator.add(out) if self.accumulator is not None else out


def merge_deltas(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """Two consecutive delta outputs of one request as one (``older``'s lists are not modified)."""
    merged = {c.index: c for c in older.outputs}
    for c in newer.outputs:
        prev = merged.get(c.index)
        if prev is None:
            merged[c.index] = c
            continue
        logprobs = prev.logprobs
        if c.logprobs is not None:
            logprobs = (logprobs or []) + c.logprobs
        merged[c.index] = CompletionOutput(
            index=c.index,
            text=prev.text + c.text,
            token_ids=prev.token_ids + c.token_ids,
            cumulative_logprob=c.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
    return RequestOutput(
        request_id=newer.request_id,
        prompt=newer.prompt,
        prompt_token_ids=newer.prompt_token_ids,
        outputs=[merged[i] for i in sorted(merged)],
        finished=newer.finished,
        num_cached_tokens=newer.num_cached_tokens,
        prompt_logprobs=older.prompt_logprobs if older.prompt_logprobs is not None else newer.prompt_logprobs,
        metrics=newer.metrics,
    )


__all__ = [
    "OutputAccumulator",
    "OutputDecoder",
    "Times",
    "decode_output",
    "encode_output",
    "merge_deltas",
    "metrics_from_times",
    "metrics_times",
]
