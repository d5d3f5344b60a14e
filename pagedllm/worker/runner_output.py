"""What a launched step hands back to the engine: its sampled rows, their tokens (on the device until
asked for) and its prompt logprobs. The model runner writes no request state."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.outputs import Logprob
from pagedllm.sample.sampler import DeviceSamples, SampledTokens


class DeferredSamples:
    """A step's sampling, run when its tokens are asked for (:meth:`output`): a pipelined step's
    logits reach the driver only after later steps were launched."""

    def __init__(self, sample: Callable[[], DeviceSamples]) -> None:
        self._sample = sample

    def output(self) -> SampledTokens:
        return self._sample().output()


class VerifiedSamples:
    """A speculative step's tokens, verified on the host already."""

    def __init__(self, tokens: SampledTokens) -> None:
        self.tokens = tokens

    def output(self) -> SampledTokens:
        return self.tokens


# What a launched step's sampled tokens are until they are asked for.
StepSamples = DeviceSamples | DeferredSamples | VerifiedSamples

# One request's prompt logprobs from one step: (first position, entries); entry j is for the prompt
# token that position ``first + j`` predicts (prompt token ``first + j + 1``).
PromptLogprobsChunk = tuple[int, list[dict[int, Logprob] | None]]


@dataclass
class RunnerOutput:
    """What a launched step hands back to the engine (the runner writes no request state)."""

    # Indices into ``scheduled_requests`` of the rows that get a token.
    sample_rows: list[int]
    # Their tokens, on the device until asked for; None when no row samples.
    samples: StepSamples | None
    # Prompt logprobs of the prompt positions this step computed that were not reported before,
    # by request id (see PromptLogprobsChunk): the engine appends them to the request's.
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
