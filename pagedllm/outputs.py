"""What the engine returns for each request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log probability of one token, its rank in the distribution and its decoded text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence of a request (``index`` among the request's ``n``)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one request after an engine step (cumulative, not a delta)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    metrics: RequestMetrics | None = field(default=None, repr=False)


@dataclass
class EmbeddingOutput:
    """The embedding of one prompt: its pooled (and, as configured, truncated and normalised) final
    hidden state."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """The result of a pooling request (``LLM.embed``): always final, since a prompt is pooled in the
    one step that computes it. ``outputs.embedding`` is the vector (``embedding`` for short)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    metrics: RequestMetrics | None = field(default=None, repr=False)

    @property
    def embedding(self) -> list[float]:
        return self.outputs.embedding


@dataclass
class BeamSearchSequence:
    """One finished hypothesis.

    ``tokens`` are the prompt's token ids followed by the generated ones (an ending EOS included);
    ``text`` is the generated part decoded (special tokens skipped). ``score`` is ``cum_logprob``
    divided by ``generated_len ** length_penalty``. ``finish_reason`` is ``"stop"`` for a hypothesis
    ended by EOS and ``"length"`` for one cut at ``max_tokens``.
    """

    tokens: list[int]
    cum_logprob: float
    num_prompt_tokens: int
    score: float
    finish_reason: str
    text: str = ""

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    """The finished hypotheses of one prompt, best (highest score) first."""

    sequences: list[BeamSearchSequence]
    prompt: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
