"""Sampling parameters of one request (vLLM field names), validated with field-named errors."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from pagedllm.errors import RequestError


class RequestOutputKind(enum.Enum):
    """Which ``RequestOutput`` snapshots a request produces while it runs."""

    CUMULATIVE = 0  # one after every step that gave it a token, with everything so far
    # One after every step that gave it a token, with only what is new since the previous one
    # (streaming): the new text, token ids and logprobs of each sequence that gained any (or just
    # finished; its finish reason is in that output alone), the prompt logprobs in the first output,
    # the cumulative logprob as the running total. Concatenated, they are the cumulative output.
    DELTA = 1
    FINAL_ONLY = 2  # only the final one (offline generation: no per-step snapshots to build)


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a JSON schema, a regex, a choice of strings or an EBNF grammar.

    Exactly one of the constraint fields (``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object``) must be set.

    ``after`` (token ids, e.g. those of a reasoning model's ``</think>``) delays the constraint: until
    this id sequence has appeared, contiguously, in the generated tokens, sampling is unconstrained
    and the grammar's matcher is not advanced; the grammar applies to every token after it (the
    marker's own tokens are not part of the constrained text). Only output tokens count: a prompt that
    already ends with the marker does not start the constraint, so leave ``after`` unset then. A
    sequence that ends before the marker appears (EOS, a stop, ``max_tokens``) was never constrained.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    after: list[int] | None = None

    def __post_init__(self) -> None:
        # Types first: these parameters cross process boundaries and reach the grammar compiler, so a
        # value of the wrong type is refused here, naming the field, wherever the parameters come from.
        if self.json is not None and not isinstance(self.json, str | dict):
            raise RequestError(
                "structured_outputs",
                "structured_outputs.json must be a JSON schema (an object, or its JSON text), got "
                f"{type(self.json).__name__} {self.json!r:.60}",
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise RequestError(
                    "structured_outputs",
                    f"structured_outputs.{name} must be a string, got {type(value).__name__}",
                )
        if self.choice is not None and not isinstance(self.choice, list | tuple):
            raise RequestError(
                "structured_outputs",
                f"structured_outputs.choice must be a list of strings, got {type(self.choice).__name__}",
            )
        if not isinstance(self.json_object, bool):
            raise RequestError(
                "structured_outputs",
                f"structured_outputs.json_object must be a boolean, got {type(self.json_object).__name__}",
            )
        set_fields = [
            name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(set_fields) != 1:
            raise RequestError(
                "structured_outputs",
                "structured_outputs: exactly one of json, regex, choice, grammar, json_object must be set "
                f"(got {set_fields or 'none'})",
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise RequestError(
                "structured_outputs",
                "structured_outputs.choice must be a non-empty list of non-empty strings",
            )
        if self.after is not None:
            if not isinstance(self.after, list | tuple) or not self.after:
                raise RequestError(
                    "structured_outputs", "structured_outputs.after must be a non-empty list of token ids"
                )
            for t in self.after:
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    raise RequestError(
                        "structured_outputs",
                        f"structured_outputs.after must contain non-negative integers, got {t!r}",
                    )
            self.after = list(self.after)


# Temperatures above this flatten every distribution to uniform sampling; larger values are refused.
MAX_TEMPERATURE = 100.0


@dataclass
class SamplingParams:
    """How to sample the completion of one prompt.

    ``temperature == 0`` means greedy. ``top_k`` of 0 or -1 disables top-k. ``top_p == 1`` and
    ``min_p == 0`` disable those filters. ``seed`` gives a per-request generator, so the sampled
    tokens do not depend on what else is in the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    best_of: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled by the engine: extra token ids that end generation (the model's EOS ids).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            if any(isinstance(k, bool) or isinstance(v, bool) for k, v in self.logit_bias.items()):
                raise RequestError("logit_bias", "logit_bias must map token ids to numbers, not booleans.")
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError) as e:
                raise RequestError("logit_bias", f"logit_bias must map token ids to numbers: {e}") from None
        self._verify()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def _verify(self) -> None:
        def bad(field_name: str, msg: str) -> RequestError:
            return RequestError(field_name, f"{field_name} {msg}")

        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise bad("n", f"must be an integer of at least 1, got {self.n!r}.")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise bad(name, f"must be a finite number, got {value!r}.")
        if self.best_of is not None and self.best_of != self.n:
            raise bad("best_of", "is not supported; use n instead.")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be -1 or 0 (disable) or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens",
                f"must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.",
            )
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}.")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", f"must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise bad("prompt_logprobs", f"must be non-negative, got {self.prompt_logprobs}.")
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                if not -100.0 <= bias <= 100.0:  # NaN fails this too
                    raise bad("logit_bias", f"values must be in [-100, 100], got {bias} for token {tok}.")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            raise bad("allowed_token_ids", "must not be empty.")
        for s in self.stop:  # type: ignore[union-attr]
            if not isinstance(s, str) or not s:
                raise bad("stop", "must contain only non-empty strings.")
        for name in ("stop_token_ids", "allowed_token_ids"):
            for t in getattr(self, name) or []:
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    raise bad(name, f"must contain non-negative integers, got {t!r}.")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", f"must be a RequestOutputKind, got {self.output_kind!r}.")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer, got {self.seed!r}.")

    def verify_vocab(self, vocab_size: int) -> None:
        """Check token-id fields against the model's vocabulary."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids or []),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("logit_bias", list((self.logit_bias or {}).keys())),
            (
                "structured_outputs.after",
                (self.structured_outputs.after if self.structured_outputs else None) or [],
            ),
        ):
            for t in ids:
                if not 0 <= t < vocab_size:
                    raise RequestError(
                        name.split(".")[0],
                        f"{name} contains out-of-vocab token id {t} (vocab size {vocab_size}).",
                    )

    def clone(self) -> SamplingParams:
        import copy

        return copy.deepcopy(self)


@dataclass
class BeamSearchParams:
    """Beam search settings (scoring as HF transformers with early_stopping=True)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise RequestError("beam_width", f"beam_width must be at least 1, got {self.beam_width}.")
        if self.max_tokens < 1:
            raise RequestError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}.")
