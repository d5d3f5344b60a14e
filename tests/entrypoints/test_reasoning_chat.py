"""Reasoning in chat replies: a real server with ``--reasoning-parser deepseek_r1`` and the official
``openai`` client. SmolLM2-135M writes ``<think>…</think>`` when the history shows it doing so."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from helpers.server import SMALL_ENGINE_ARGS, TOOL_TEMPLATE, RemoteServer

SHOTS: list[dict[str, Any]] = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>Two plus two makes four.</think>4"},
    {"role": "user", "content": "What is 3+5?"},
    {"role": "assistant", "content": "<think>Three plus five makes eight.</think>8"},
    {"role": "user", "content": "What is 6+1?"},
]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    args = [*SMALL_ENGINE_ARGS, "--reasoning-parser", "deepseek_r1", "--chat-template", str(TOOL_TEMPLATE)]
    with RemoteServer(args) as srv:
        yield srv
        srv.wait_idle()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


def _ask(client: openai.OpenAI, **kwargs: Any) -> Any:
    model = client.models.list().data[0].id
    return client.chat.completions.create(**{"model": model, "temperature": 0, "max_tokens": 40, **kwargs})


def _streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[list[tuple[str, str]], list[Any]]:
    """The (kind, text) deltas in order, and the tool-call pieces."""
    deltas: list[tuple[str, str]] = []
    calls: list[Any] = []
    for chunk in _ask(client, stream=True, **kwargs):
        for choice in chunk.choices:
            reasoning = getattr(choice.delta, "reasoning_content", None)
            if reasoning:
                deltas.append(("reasoning", reasoning))
            if choice.delta.content:
                deltas.append(("content", choice.delta.content))
            calls += choice.delta.tool_calls or []
    return deltas, calls


def test_reasoning_is_split_from_content_and_streamed_first(client: openai.OpenAI) -> None:
    message = _ask(client, messages=SHOTS).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert message.content and "</think>" not in message.content
    deltas, _ = _streamed(client, messages=SHOTS)
    kinds = [kind for kind, _ in deltas]
    assert kinds == sorted(kinds, key=["reasoning", "content"].index)  # all reasoning, then content
    assert "".join(t for k, t in deltas if k == "reasoning") == reasoning
    assert "".join(t for k, t in deltas if k == "content") == message.content


def test_a_reply_without_the_end_tag_is_all_reasoning(client: openai.OpenAI) -> None:
    reply = _ask(client, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12).choices[0]
    assert reply.message.content is None
    assert reply.message.model_extra["reasoning_content"]


def test_structured_output_starts_after_the_reasoning(client: openai.OpenAI) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "sum", "schema": SCHEMA}}
    message = _ask(client, messages=SHOTS, response_format=response_format).choices[0].message
    assert message.model_extra["reasoning_content"]  # free text, not JSON
    jsonschema.validate(json.loads(message.content), SCHEMA)
    deltas, _ = _streamed(client, messages=SHOTS, response_format=response_format)
    assert "".join(t for k, t in deltas if k == "content") == message.content


def test_required_tool_call_after_the_reasoning(client: openai.OpenAI) -> None:
    reply = _ask(
        client, messages=SHOTS, tools=[TOOL], tool_choice="required", parallel_tool_calls=False, max_tokens=80
    ).choices[0]
    assert reply.finish_reason == "tool_calls", reply
    assert reply.message.model_extra["reasoning_content"]
    [call] = reply.message.tool_calls
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])
    deltas, pieces = _streamed(
        client, messages=SHOTS, tools=[TOOL], tool_choice="required", parallel_tool_calls=False, max_tokens=80
    )
    assert "".join(t for k, t in deltas if k == "reasoning") == reply.message.model_extra["reasoning_content"]
    assert "".join(p.function.arguments or "" for p in pieces if p.function) == call.function.arguments
