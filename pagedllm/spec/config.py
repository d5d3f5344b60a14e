"""The ``speculative_config`` option: which proposer drafts tokens and how many per step.

Two forms are accepted, with vLLM's keys:

- prompt lookup: ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": a,
  "prompt_lookup_min": b}``. Either bound may be left out and then equals the other; with both left
  out, both are 5 (vLLM's defaults);
- a draft model that shares the target's tokenizer: ``{"model": PATH, "num_speculative_tokens": k}``
  (``"method": "draft_model"`` may be given or is implied by ``model``), optionally with
  ``"quantization"``: how the draft's weights are held, as the engine's ``quantization`` option
  (default ``"auto"``: as its checkpoint stores them, whatever the target's setting, so a quantized
  GGUF file can draft for a float target).

Every error is a ValueError whose message starts with the offending field, as
``speculative_config.<field>``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pagedllm.config import QUANTIZATION_METHODS

SpeculativeMethod = Literal["ngram", "draft_model"]
METHODS: tuple[SpeculativeMethod, ...] = ("ngram", "draft_model")
ACCEPTED_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "model",
    "quantization",
)
DEFAULT_PROMPT_LOOKUP = 5


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated speculative-decoding configuration.

    Invariants (checked on construction): ``method`` is ``"ngram"`` or ``"draft_model"``;
    ``num_speculative_tokens >= 1``; for ``"ngram"``, ``model`` is None and
    ``1 <= prompt_lookup_min <= prompt_lookup_max`` (a bound left as None takes the other's value,
    both None take 5) and ``quantization`` is None; for ``"draft_model"``, ``model`` is a non-empty
    path, both bounds are None and ``quantization`` is one of the engine's methods (None: ``"auto"``).
    """

    method: SpeculativeMethod
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    quantization: str | None = None  # the draft model's weights (draft_model only; None: "auto")

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(map(repr, METHODS))}, got {self.method!r}"
            )
        _positive_int("num_speculative_tokens", self.num_speculative_tokens)
        if self.method == "ngram":
            self._check_ngram()
        else:
            self._check_draft_model()

    def _check_ngram(self) -> None:
        if self.model is not None:
            raise ValueError(
                f"speculative_config.model must not be set with method 'ngram' (prompt lookup drafts "
                f"from the sequence itself), got {self.model!r}"
            )
        if self.quantization is not None:
            raise ValueError("speculative_config.quantization applies to a draft model only, not 'ngram'")
        high, low = self.prompt_lookup_max, self.prompt_lookup_min
        if high is not None:
            high = _positive_int("prompt_lookup_max", high)
        if low is not None:
            low = _positive_int("prompt_lookup_min", low)
        if high is None and low is None:
            high = low = DEFAULT_PROMPT_LOOKUP
        elif high is None:
            high = low
        elif low is None:
            low = high
        assert high is not None and low is not None
        if low > high:
            raise ValueError(
                f"speculative_config.prompt_lookup_min must be at most prompt_lookup_max ({high}), got {low}"
            )
        object.__setattr__(self, "prompt_lookup_max", high)
        object.__setattr__(self, "prompt_lookup_min", low)

    def _check_draft_model(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(
                f"speculative_config.model must be the draft model's path with method 'draft_model', "
                f"got {self.model!r}"
            )
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"speculative_config.{name} applies to method 'ngram' only, not 'draft_model'"
                )
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"speculative_config.quantization must be one of {', '.join(QUANTIZATION_METHODS)}, "
                f"got {self.quantization!r}"
            )


def parse_speculative_config(
    value: str | dict[str, Any] | SpeculativeConfig | None,
) -> SpeculativeConfig | None:
    """``value`` (a JSON object as text, a dict, a config, or None) as a :class:`SpeculativeConfig`.

    None and the empty string give None (speculative decoding off). Keys whose value is null count as
    absent. Without ``method``, a ``model`` implies ``"draft_model"``; with neither, it is an error.
    """
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    unknown = sorted(str(key) for key in value if key not in ACCEPTED_KEYS)
    if unknown:
        raise ValueError(
            f"speculative_config has unknown keys {', '.join(unknown)}; accepted keys: {', '.join(ACCEPTED_KEYS)}"
        )
    fields = {key: v for key, v in value.items() if v is not None}
    if "num_speculative_tokens" not in fields:
        raise ValueError("speculative_config.num_speculative_tokens is required")
    method = fields.pop("method", None)
    if method is None:
        if "model" not in fields:
            raise ValueError(
                "speculative_config.method is required without a draft model: 'ngram' for prompt lookup, "
                "or give speculative_config.model"
            )
        method = "draft_model"
    return SpeculativeConfig(method=method, **fields)


def check_draft_vocab(target_vocab_size: int, draft_vocab_size: int) -> None:
    """Raise ValueError unless the draft model's vocabulary is the target's (same size): the draft's
    token ids are fed to the target as they are, so both must come from one tokenizer."""
    if target_vocab_size != draft_vocab_size:
        raise ValueError(
            f"speculative_config.model has a vocabulary of {draft_vocab_size} tokens but the target model "
            f"has {target_vocab_size}; the draft model must share the target's tokenizer"
        )
