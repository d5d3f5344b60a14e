"""Delta outputs added up: what a caller that wants cumulative outputs gets from delta ones.

A request run with :attr:`~pagedllm.sampling_params.RequestOutputKind.DELTA` output gets, every step,
only what each sequence gained (the output processor makes them). :class:`OutputAccumulator` turns them
back into cumulative outputs for callers that want those; :func:`merge_deltas` makes one delta of two
consecutive ones, for a caller that fell behind.
"""

from __future__ import annotations

from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput


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


__all__ = ["OutputAccumulator", "merge_deltas"]
