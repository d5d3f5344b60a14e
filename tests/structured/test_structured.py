"""Structured outputs: every constrained output parses and validates, mixed with unconstrained rows."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

from helpers.reference import assert_greedy_close
from pagedllm import SamplingParams, StructuredOutputsParams
from pagedllm.outputs import RequestOutput

PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "color", "tags", "address"],
    "additionalProperties": False,
}

ITEMS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
                "required": ["id", "ok"],
            },
            "minItems": 1,
            "maxItems": 2,
        },
        "total": {"type": "number"},
    },
    "required": ["items", "total"],
}

PHONE_REGEX = r"\d{3}-\d{4}"
WORD_REGEX = r"(cat|dog)s? [a-z]{2,6}"
CHOICES = ["positive", "negative", "neutral"]

MAX_TOKENS = 96


def check_schema(value: Any, schema: dict[str, Any], path: str = "$") -> None:
    """Assert ``value`` satisfies the subset of JSON Schema used by these tests."""
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict), f"{path}: expected an object, got {value!r}"
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            assert key in value, f"{path}: missing required {key!r}"
        if schema.get("additionalProperties") is False:
            extra = set(value) - set(props)
            assert not extra, f"{path}: unexpected properties {extra}"
        for key, sub in props.items():
            if key in value:
                check_schema(value[key], sub, f"{path}.{key}")
    elif kind == "array":
        assert isinstance(value, list), f"{path}: expected an array, got {value!r}"
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)), path
        for i, item in enumerate(value):
            check_schema(item, schema.get("items", {}), f"{path}[{i}]")
    elif kind == "string":
        assert isinstance(value, str), f"{path}: expected a string, got {value!r}"
        assert schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)), path
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), f"{path}: expected an integer"
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), f"{path}: {value}"
    elif kind == "number":
        assert isinstance(value, int | float) and not isinstance(value, bool), f"{path}: expected a number"
    elif kind == "boolean":
        assert isinstance(value, bool), f"{path}: expected a boolean, got {value!r}"


def _so(**kwargs: Any) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)


# (name, prompt, params); the unconstrained rows are interleaved with the constrained ones.
CASES: list[tuple[str, str, SamplingParams]] = [
    (
        "json_greedy",
        "Describe a person as JSON:",
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=_so(json=PERSON_SCHEMA)),
    ),
    ("plain_a", "The capital of France is", SamplingParams(temperature=0, max_tokens=12, logprobs=5)),
    (
        "json_sampled_n2",
        "Here is a user record in JSON:",
        SamplingParams(
            n=2, temperature=0.8, seed=7, max_tokens=MAX_TOKENS, structured_outputs=_so(json=PERSON_SCHEMA)
        ),
    ),
    (
        "json_str_schema",
        "List the items as JSON:",
        SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, structured_outputs=_so(json=json.dumps(ITEMS_SCHEMA))
        ),
    ),
    (
        "regex_phone",
        "Call me at",
        SamplingParams(temperature=0, max_tokens=16, structured_outputs=_so(regex=PHONE_REGEX)),
    ),
    (
        "regex_words",
        "My favourite animal:",
        SamplingParams(temperature=0.7, seed=3, max_tokens=16, structured_outputs=_so(regex=WORD_REGEX)),
    ),
    (
        "choice",
        "Review: I loved this film. Sentiment:",
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=_so(choice=CHOICES)),
    ),
    (
        "choice_ignore_eos",
        "Is the sky blue? Answer:",
        SamplingParams(
            temperature=0, max_tokens=8, ignore_eos=True, structured_outputs=_so(choice=["yes", "no"])
        ),
    ),
    (
        "json_object",
        "Output a small JSON object:",
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=_so(json_object=True)),
    ),
    ("plain_b", "Once upon a time", SamplingParams(temperature=0, max_tokens=12, logprobs=5)),
]


@pytest.fixture(scope="module")
def mixed_outputs(default_llm: Any) -> dict[str, RequestOutput]:
    outs = default_llm.generate([c[1] for c in CASES], [c[2] for c in CASES], use_tqdm=False)
    default_llm.llm_engine.check_idle()
    return {name: out for (name, _, _), out in zip(CASES, outs, strict=True)}


def _texts(out: RequestOutput) -> list[str]:
    for o in out.outputs:
        assert o.finish_reason == "stop", f"did not finish by the grammar: {o.finish_reason} {o.text!r}"
    return [o.text for o in out.outputs]


@pytest.mark.parametrize("name", ["json_greedy", "json_sampled_n2"])
def test_json_schema_outputs_validate(mixed_outputs: dict[str, RequestOutput], name: str) -> None:
    texts = _texts(mixed_outputs[name])
    for text in texts:
        check_schema(json.loads(text), PERSON_SCHEMA)
    assert len(texts) == (2 if name == "json_sampled_n2" else 1)


def test_json_schema_given_as_string(mixed_outputs: dict[str, RequestOutput]) -> None:
    for text in _texts(mixed_outputs["json_str_schema"]):
        check_schema(json.loads(text), ITEMS_SCHEMA)


@pytest.mark.parametrize(("name", "pattern"), [("regex_phone", PHONE_REGEX), ("regex_words", WORD_REGEX)])
def test_regex_outputs_fullmatch(mixed_outputs: dict[str, RequestOutput], name: str, pattern: str) -> None:
    for text in _texts(mixed_outputs[name]):
        assert re.fullmatch(pattern, text), text


def test_choice_outputs(mixed_outputs: dict[str, RequestOutput]) -> None:
    for text in _texts(mixed_outputs["choice"]):
        assert text in CHOICES
    # With ignore_eos the grammar's termination (after EOS) still ends the sequence.
    for text in _texts(mixed_outputs["choice_ignore_eos"]):
        assert text in ("yes", "no")


def test_json_object_parses(mixed_outputs: dict[str, RequestOutput]) -> None:
    for text in _texts(mixed_outputs["json_object"]):
        assert isinstance(json.loads(text), dict)


def test_unconstrained_rows_unaffected(default_llm: Any, mixed_outputs: dict[str, RequestOutput]) -> None:
    names = ["plain_a", "plain_b"]
    cases = {c[0]: c for c in CASES}
    alone = default_llm.generate([cases[n][1] for n in names], [cases[n][2] for n in names], use_tqdm=False)
    for name, out in zip(names, alone, strict=True):
        mixed = mixed_outputs[name].outputs[0]
        single = out.outputs[0]
        assert_greedy_close(mixed.token_ids, mixed.logprobs, single.token_ids, single.logprobs, label=name)
    default_llm.llm_engine.check_idle()


@pytest.mark.parametrize(
    ("so", "match"),
    [
        (_so(json={"type": "object", "properties": {"a": {"type": "foo"}}}), "structured_outputs.json.*foo"),
        (_so(json='{"type": "object", "properties": '), "structured_outputs.json.*not valid JSON"),
        (_so(json={"type": "object", "default": {1, 2}}), "structured_outputs.json.*not serializable"),
        (_so(regex="a(b"), "structured_outputs.regex.*invalid regex.*parenthesis"),
        (_so(regex="[z-a]"), "structured_outputs.regex.*invalid regex"),
        (_so(grammar="root ::= item\n"), "structured_outputs.grammar.*item"),
    ],
)
def test_invalid_constraint_raises(default_llm: Any, so: StructuredOutputsParams, match: str) -> None:
    good = SamplingParams(max_tokens=4)
    bad = SamplingParams(max_tokens=4, structured_outputs=so)
    with pytest.raises(ValueError, match=match):
        default_llm.generate(["Hello", "Hello"], [good, bad], use_tqdm=False)
    default_llm.llm_engine.check_idle()


def test_grammar_cache(default_llm: Any) -> None:
    from pagedllm.structured import StructuredOutputManager

    engine = default_llm.llm_engine
    manager = engine.structured_output_manager
    before = manager.num_compilations
    a = manager.compile(_so(regex=r"x\d"))
    assert manager.compile(_so(regex=r"x\d")) is a
    assert manager.num_compilations == before + 1

    small = StructuredOutputManager(engine.tokenizer, engine.vocab_size, engine.eos_token_ids, cache_size=2)
    first = small.compile(_so(choice=["a", "b"]))
    small.compile(_so(regex="a+"))
    assert small.compile(_so(choice=["a", "b"])) is first  # refreshed: now the most recent
    small.compile(_so(json_object=True))  # evicts regex "a+", the least recently used
    assert small.num_compilations == 3
    small.compile(_so(choice=["a", "b"]))
    assert small.num_compilations == 3
    small.compile(_so(regex="a+"))
    assert small.num_compilations == 4


def test_bitmask_masks_only_constrained_rows_and_allows_eos_when_complete(default_llm: Any) -> None:
    from pagedllm.structured import apply_grammar_bitmask

    engine = default_llm.llm_engine
    manager = engine.structured_output_manager
    eos = engine.eos_token_ids[0]
    vocab = engine.vocab_size
    choice = manager.new_state(manager.compile(_so(choice=["yes", "no"])))
    digits = manager.new_state(manager.compile(_so(regex=r"\d+")))
    logits = torch.zeros(3, vocab)
    apply_grammar_bitmask(logits, [choice, None, digits])
    assert torch.equal(logits[1], torch.zeros(vocab))  # unconstrained row untouched
    assert logits[0, eos] == float("-inf") and logits[2, eos] == float("-inf")  # cannot end yet
    assert 0 < int(torch.isfinite(logits[0]).sum()) < vocab

    for token in engine.tokenizer.encode("yes", add_special_tokens=False):
        assert choice.accept_token(token)
    for token in engine.tokenizer.encode("12", add_special_tokens=False):
        assert digits.accept_token(token)
    logits = torch.zeros(2, vocab)
    apply_grammar_bitmask(logits, [choice, digits])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [eos]  # complete: only EOS
    assert logits[1, eos] == 0.0 and int(torch.isfinite(logits[1]).sum()) > 1  # EOS or more digits
    assert choice.accept_token(eos) and choice.is_terminated
    assert not digits.accept_token(engine.tokenizer.encode("a", add_special_tokens=False)[0])
