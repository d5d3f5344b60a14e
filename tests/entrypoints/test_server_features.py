"""Server features on top of plain sampling: structured outputs (``response_format`` and the
``structured_outputs`` extra), beam search, prompt logprobs and echoed logprobs, end to end against one
real ``pagedllm serve`` process through the official ``openai`` client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from helpers.server import SMALL_ENGINE_ARGS, RemoteServer
from pagedllm.sampling_params import BeamSearchParams

MODEL = "features-model"

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "c": {"type": "string", "enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "s": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2},
        "o": {
            "type": "object",
            "properties": {"r": {"type": "boolean"}},
            "required": ["r"],
            "additionalProperties": False,
        },
    },
    "required": ["c", "n", "s", "o"],
    "additionalProperties": False,
}
# A one-line example keeps the constrained answer short (whitespace between tokens is allowed).
EXAMPLE = '{"c":"blue","n":3,"s":[1],"o":{"r":false}}'


def validate(value: Any, schema: dict[str, Any], path: str = "$") -> None:
    """A minimal JSON-schema check (type, enum, bounds, items, properties); raises AssertionError."""
    kind = schema.get("type")
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
    if kind == "object":
        assert isinstance(value, dict), f"{path}: not an object"
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            assert key in value, f"{path}: missing {key!r}"
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), f"{path}: unexpected keys {set(value) - set(props)}"
        for key, sub in value.items():
            if key in props:
                validate(sub, props[key], f"{path}.{key}")
    elif kind == "array":
        assert isinstance(value, list), f"{path}: not an array"
        assert len(value) <= schema.get("maxItems", len(value)), f"{path}: too many items"
        for i, item in enumerate(value):
            validate(item, schema["items"], f"{path}[{i}]")
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), f"{path}: not an integer"
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), f"{path}: out of range"
    elif kind == "string":
        assert isinstance(value, str), f"{path}: not a string"
    elif kind == "boolean":
        assert isinstance(value, bool), f"{path}: not a boolean"


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    with RemoteServer([*SMALL_ENGINE_ARGS, "--served-model-name", MODEL]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


def _chat(client: openai.OpenAI, content: str, **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", 24)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **kwargs
    )


def test_response_format_json_object(client: openai.OpenAI) -> None:
    resp = _chat(
        client,
        'Reply with a JSON object with one key "a" whose value is 1.',
        response_format={"type": "json_object"},
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content or ""), dict)


def test_response_format_json_schema(client: openai.OpenAI) -> None:
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "item", "schema": SCHEMA, "strict": True},
    }
    resp = _chat(
        client,
        f"Describe a red ball as minified JSON on one line, like {EXAMPLE}",
        response_format=response_format,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    validate(json.loads(choice.message.content or ""), SCHEMA)
    # The completions endpoint takes the same response_format.
    comp = client.completions.create(
        model=MODEL,
        prompt=f"Minified JSON: {EXAMPLE}\nMinified JSON:",
        max_tokens=24,
        temperature=0,
        extra_body={"response_format": response_format},
    )
    validate(json.loads(comp.choices[0].text), SCHEMA)  # complete (may end exactly at max_tokens)


def test_structured_outputs_choice(client: openai.OpenAI) -> None:
    choices = ["positive", "negative"]
    resp = _chat(
        client,
        "Is 'I love this film' positive or negative?",
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert resp.choices[0].message.content in choices
    comp = client.completions.create(
        model=MODEL,
        prompt="The sky is",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "(blue|grey)"}},
    )
    assert comp.choices[0].text in ("blue", "grey")


def test_invalid_constraints_are_400(client: openai.OpenAI) -> None:
    bad_schema = {"type": "object", "properties": {"a": {"type": "foo"}}}
    with pytest.raises(openai.BadRequestError) as err:
        _chat(
            client,
            "Hi",
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad_schema}},
        )
    body = err.value.body
    assert isinstance(body, dict)
    assert body["param"] == "response_format" and "foo" in body["message"], body
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=4, extra_body={"structured_outputs": {"regex": "a(b"}}
        )
    body = err.value.body
    assert isinstance(body, dict)
    assert body["param"] == "structured_outputs" and "regex" in body["message"], body


def test_beam_search_matches_offline(client: openai.OpenAI, default_llm: Any) -> None:
    prompt = "The best thing about Paris is"
    kwargs: dict[str, Any] = dict(model=MODEL, prompt=prompt, max_tokens=8, n=3)
    resp = client.completions.create(**kwargs, extra_body={"use_beam_search": True, "length_penalty": 1.0})
    again = client.completions.create(**kwargs, extra_body={"use_beam_search": True, "length_penalty": 1.0})
    texts = [c.text for c in sorted(resp.choices, key=lambda c: c.index)]
    assert len(texts) == 3
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    offline = default_llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=8))[0].sequences
    assert texts[0] == offline[0].text
    assert texts == [s.text for s in offline]
    assert resp.usage is not None
    assert resp.usage.completion_tokens == sum(len(s.output_token_ids) for s in offline)

    chat = _chat(client, "Name a colour.", max_tokens=6, n=2, extra_body={"use_beam_search": True})
    assert len(chat.choices) == 2 and all(c.message.content for c in chat.choices)

    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**kwargs, stream=True, extra_body={"use_beam_search": True})
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == "stream", body


def test_chat_logprobs_and_prompt_logprobs(client: openai.OpenAI) -> None:
    resp = _chat(
        client, "Say hi.", max_tokens=5, logprobs=True, top_logprobs=3, extra_body={"prompt_logprobs": 2}
    )
    choice = resp.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert len(choice.logprobs.content) == resp.usage.completion_tokens  # type: ignore[union-attr]
    for entry in choice.logprobs.content:
        assert entry.logprob <= 0.0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
    prompt_logprobs = resp.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert len(prompt_logprobs) == resp.usage.prompt_tokens  # type: ignore[union-attr]
    assert prompt_logprobs[0] is None
    for position in prompt_logprobs[1:]:
        assert 1 <= len(position) <= 3
        assert all(v["logprob"] <= 0.0 and "decoded_token" in v for v in position.values())


@pytest.mark.parametrize("stream", [False, True])
def test_logprob_bytes_are_the_tokens_own(client: openai.OpenAI, stream: bool) -> None:
    """Emoji split across tokens: each entry's ``bytes`` are its token's (not U+FFFD's), so they add
    up to the reply's UTF-8; a token that is part of a character shows ``\\xNN`` escapes; the same in
    a stream."""
    choices = ["\U0001f4a1 idea", "\U0001f389 party"]
    kwargs: dict[str, Any] = {
        "logprobs": True,
        "top_logprobs": 2,
        "extra_body": {"structured_outputs": {"choice": choices}},
    }
    if stream:
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Pick one."}],
                temperature=0,
                max_tokens=16,
                stream=True,
                **kwargs,
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        entries = [
            e
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for e in c.choices[0].logprobs.content or []
        ]
    else:
        resp = _chat(client, "Pick one.", max_tokens=16, **kwargs)
        text = resp.choices[0].message.content or ""
        assert resp.choices[0].logprobs is not None
        entries = list(resp.choices[0].logprobs.content or [])
    assert text in choices
    if entries and entries[-1].token == "<|im_end|>":  # the end-of-turn token ends the reply
        entries.pop()
    assert b"".join(bytes(e.bytes or []) for e in entries) == text.encode("utf-8")
    partial = [e for e in entries if e.token.startswith("\\x")]
    assert partial, [e.token for e in entries]
    assert all(e.bytes != [239, 191, 189] for e in entries)
    for e in entries:
        for top in e.top_logprobs:
            assert top.bytes is not None and "\ufffd" not in top.token


def test_completion_echo_logprobs_fill_prompt(client: openai.OpenAI) -> None:
    prompt = "Hello there, my friend"
    resp = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2
    )
    choice = resp.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert resp.usage is not None
    n_prompt, n_out = resp.usage.prompt_tokens, resp.usage.completion_tokens
    assert len(lp.tokens) == n_prompt + n_out
    assert "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs is not None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0.0 for x in lp.token_logprobs[1:])
    assert all(top is not None and 1 <= len(top) <= 3 for top in lp.top_logprobs[1:])

    # prompt_logprobs is returned per choice, and refused with streaming.
    plain = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    entries = plain.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert len(entries) == n_prompt and entries[0] is None
    first = entries[1]
    # The same prompt position reports the same log probability of the prompt token either way.
    token_id = next(iter(k for k, v in first.items() if v["decoded_token"] == lp.tokens[1]))
    assert first[token_id]["logprob"] == pytest.approx(lp.token_logprobs[1], abs=1e-4)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1}
        )


def test_metrics_idle_after_all(server: RemoteServer) -> None:
    def idle(s: dict[str, float]) -> bool:
        return s["pagedllm:num_requests_running"] == 0 and s["pagedllm:num_requests_waiting"] == 0

    samples = server.wait_for_metrics(idle, timeout=10)
    assert idle(samples), samples
    # Finished requests keep only prefix-cacheable blocks, which an idle engine can reclaim.
    usage = samples["pagedllm:kv_cache_usage_perc"]
    assert 0.0 <= usage < 0.05, usage
