"""The speculative_config option: the two accepted forms, vLLM's defaults, and errors naming the field."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from pagedllm.spec import SpeculativeConfig, check_draft_vocab, parse_speculative_config


def test_ngram_form_from_json_text() -> None:
    config = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 2}'
    )
    assert config == SpeculativeConfig(
        method="ngram", num_speculative_tokens=4, prompt_lookup_max=5, prompt_lookup_min=2, model=None
    )


def test_draft_model_form_implies_its_method() -> None:
    config = parse_speculative_config({"model": "/models/draft", "num_speculative_tokens": 3})
    assert config is not None
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", "/models/draft", 3)
    assert config.prompt_lookup_max is None and config.prompt_lookup_min is None
    explicit = parse_speculative_config(
        {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 3}
    )
    assert explicit == config


@pytest.mark.parametrize(
    ("bounds", "expected"),
    [
        ({}, (5, 5)),  # vLLM's defaults when neither bound is given
        ({"prompt_lookup_max": 3}, (3, 3)),  # a missing bound takes the other's value
        ({"prompt_lookup_min": 2}, (2, 2)),
        ({"prompt_lookup_max": 4, "prompt_lookup_min": None}, (4, 4)),  # null counts as absent
        ({"prompt_lookup_max": 1, "prompt_lookup_min": 1}, (1, 1)),
    ],
)
def test_ngram_bounds_defaults(bounds: dict[str, Any], expected: tuple[int, int]) -> None:
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, **bounds})
    assert config is not None
    assert (config.prompt_lookup_max, config.prompt_lookup_min) == expected


def test_off_values_and_passthrough() -> None:
    assert parse_speculative_config(None) is None
    assert parse_speculative_config("  ") is None
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert parse_speculative_config(config) is config
    assert (config.prompt_lookup_max, config.prompt_lookup_min) == (5, 5)


def test_config_is_frozen() -> None:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_speculative_tokens = 3  # type: ignore[misc]


NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            {**NGRAM, "num_speculative_tokens": 0},
            "speculative_config.num_speculative_tokens must be a positive integer, got 0",
        ),
        (
            {**NGRAM, "num_speculative_tokens": -3},
            "speculative_config.num_speculative_tokens must be a positive integer, got -3",
        ),
        (
            {**NGRAM, "num_speculative_tokens": 2.0},
            "speculative_config.num_speculative_tokens must be a positive integer, got 2.0",
        ),
        (
            {**NGRAM, "num_speculative_tokens": True},
            "speculative_config.num_speculative_tokens must be a positive integer, got True",
        ),
        (
            {**NGRAM, "num_speculative_tokens": "3"},
            "speculative_config.num_speculative_tokens must be a positive integer, got '3'",
        ),
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens is required"),
        (
            {**NGRAM, "prompt_lookup_min": 0},
            "speculative_config.prompt_lookup_min must be a positive integer, got 0",
        ),
        (
            {**NGRAM, "prompt_lookup_max": 0, "prompt_lookup_min": 1},
            "speculative_config.prompt_lookup_max must be a positive integer, got 0",
        ),
        (
            {**NGRAM, "prompt_lookup_max": 2, "prompt_lookup_min": 3},
            "speculative_config.prompt_lookup_min must be at most prompt_lookup_max (2), got 3",
        ),
        ({**NGRAM, "model": "/models/draft"}, "speculative_config.model must not be set with method 'ngram'"),
        (
            {"method": "draft_model", "num_speculative_tokens": 2},
            "speculative_config.model must be the draft model's path",
        ),
        (
            {"method": "draft_model", "model": "", "num_speculative_tokens": 2},
            "speculative_config.model must be the draft model's path",
        ),
        (
            {"model": "/d", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
            "speculative_config.prompt_lookup_max applies to method 'ngram' only",
        ),
        ({"num_speculative_tokens": 2}, "speculative_config.method is required without a draft model"),
        (
            {"method": "eagle", "model": "/d", "num_speculative_tokens": 2},
            "speculative_config.method must be one of 'ngram', 'draft_model', got 'eagle'",
        ),
        ("[1, 2]", "speculative_config must be a JSON object, got list"),
        ('{"method": "ngram",', "speculative_config is not valid JSON"),
    ],
)
def test_errors_name_the_field(value: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_speculative_config(value)
    assert str(info.value).startswith(message), str(info.value)


def test_unknown_keys_are_listed_with_the_accepted_ones() -> None:
    with pytest.raises(ValueError) as info:
        parse_speculative_config({**NGRAM, "num_lookahead": 3, "draft_tensor_parallel_size": 1})
    message = str(info.value)
    assert "unknown keys draft_tensor_parallel_size, num_lookahead" in message
    for key in ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"):
        assert key in message.split("accepted keys:")[1]


def test_check_draft_vocab() -> None:
    check_draft_vocab(32000, 32000)
    with pytest.raises(
        ValueError, match=r"^speculative_config\.model has a vocabulary of 32001 tokens .* 32000"
    ):
        check_draft_vocab(32000, 32001)
