"""Outputs between processes: how a core's outputs travel to the front-end, as they are.

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

from pagedllm.engine.delta_outputs import OutputAccumulator
from pagedllm.engine.proc.protocol import CompletionDelta, RequestDelta
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput

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


__all__ = [
    "OutputDecoder",
    "Times",
    "decode_output",
    "encode_output",
    "metrics_from_times",
    "metrics_times",
]
