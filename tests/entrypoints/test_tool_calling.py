"""Tool calling end to end: a real server with the shipped Hermes tool template for SmolLM2, the
official ``openai`` client and ``langchain-openai``.

``required`` and named choices are constrained by a grammar, so every call must name a declared
function and its arguments must validate; ``auto`` relies on the model, which SmolLM2-135M follows
when the conversation shows it calls (few-shot history). Streaming must reassemble to exactly the
calls of the same request answered at once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from helpers.server import RemoteServer

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 40},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current local time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 40}},
                "required": ["zone"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "convert_currency",
            "description": "Convert an amount of money from one currency to another",
            "parameters": {
                "type": "object",
                "properties": {
                    "amount": {"type": "number"},
                    "source": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]},
                    "target": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]},
                },
                "required": ["amount", "source", "target"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_web",
            "description": "Search the web",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "maxLength": 60},
                    "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
                },
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add_event",
            "description": "Add an event to the calendar",
            "parameters": {
                "type": "object",
                "properties": {
                    "title": {"type": "string", "maxLength": 40},
                    "day": {"type": "string", "enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                    "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                },
                "required": ["title", "day"],
            },
        },
    },
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}

SUBJECTS = [
    "Paris", "Tokyo", "New York", "Lagos", "Lima", "Oslo", "Mumbai", "Sydney", "Cairo", "Toronto",
]  # fmt: skip
TASKS = [
    "What is the weather like in {} today?",
    "What time is it in {} right now?",
    "How much is 120 dollars in euros? I am flying to {}.",
    "Find me the best restaurants in {}.",
    "Put a dinner in {} on my calendar for Friday at 7pm.",
]
PROMPTS = [task.format(subject) for subject in SUBJECTS for task in TASKS]  # 50 prompts


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        ],
    }


# SmolLM2-135M calls tools on its own (tool_choice "auto") once the history shows it doing so.
FEW_SHOT: list[dict[str, Any]] = [
    {"role": "system", "content": "You answer weather questions by calling get_weather."},
    {"role": "user", "content": "What's the weather in Rome?"},
    _call("call_1", "get_weather", {"city": "Rome"}),
    {"role": "user", "content": "What's the weather in Oslo?"},
    _call("call_2", "get_weather", {"city": "Oslo"}),
    {"role": "user", "content": "What's the weather in Paris?"},
]


@pytest.fixture(scope="module")
def server(tool_server: RemoteServer) -> Iterator[RemoteServer]:
    yield tool_server
    tool_server.wait_idle()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _validate(calls: list[tuple[str, dict[str, Any]]]) -> None:
    assert calls
    for name, arguments in calls:
        assert name in SCHEMAS, name
        jsonschema.validate(arguments, SCHEMAS[name])


def _stream(client: openai.OpenAI, **kwargs: Any) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """Content, tool calls reassembled from their deltas, and the finish reason of a streamed reply."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish: str | None = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        if choice.delta.content:
            content.append(choice.delta.content)
        for piece in choice.delta.tool_calls or []:
            if piece.index not in calls:
                # The first piece of a call carries its id and name, before any argument.
                assert piece.id and piece.id.startswith("call_") and piece.function and piece.function.name
                assert piece.type == "function"
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            elif piece.function and piece.function.name:
                raise AssertionError(f"a second name for call {piece.index}")
            if piece.function and piece.function.arguments:
                calls[piece.index]["arguments"] += piece.function.arguments
    assert sorted(calls) == list(range(len(calls)))
    return "".join(content) or None, [calls[i] for i in sorted(calls)], finish


def test_required_on_50_prompts_calls_declared_functions_with_valid_arguments(client: openai.OpenAI) -> None:
    model = _model(client)

    def ask(i: int) -> Any:
        return client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PROMPTS[i]}],
            tools=TOOLS,
            tool_choice="required",
            # One call per reply: allowed a list, SmolLM2-135M repeats calls until max_tokens.
            parallel_tool_calls=False,
            max_tokens=200,
            temperature=0,
        )

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(ask, range(len(PROMPTS))))
    assert len(replies) == 50
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        _validate(_calls(choice.message))
        assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    # Varied prompts get varied calls, not one memorised answer.
    assert len({name for r in replies for name, _ in _calls(r.choices[0].message)}) >= 3


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}, "auto"],
    ids=["required", "named", "auto"],
)
def test_streamed_calls_reassemble_to_the_unstreamed_ones(client: openai.OpenAI, tool_choice: Any) -> None:
    messages = (
        FEW_SHOT if tool_choice == "auto" else [{"role": "user", "content": "Weather and time in Oslo?"}]
    )
    kwargs: dict[str, Any] = {
        "model": _model(client),
        "messages": messages,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "max_tokens": 120,
        "temperature": 0.8,
        "seed": 1234,
    }
    whole = client.chat.completions.create(**kwargs).choices[0]
    content, streamed, finish = _stream(client, **kwargs)
    assert whole.finish_reason == finish == "tool_calls"
    assert content == whole.message.content
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    _validate(_calls(whole.message))
    if isinstance(tool_choice, dict):
        assert [name for name, _ in _calls(whole.message)] == ["get_time"]


def test_auto_answers_with_content_when_no_call_is_written(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=_model(client),
        messages=[{"role": "user", "content": "Say hello in French."}],
        tools=TOOLS,
        temperature=0,
        max_tokens=16,
    ).choices[0]
    assert reply.message.tool_calls in (None, [])
    assert reply.message.content and "<tool_call>" not in reply.message.content
    assert reply.finish_reason in ("stop", "length")


def test_parallel_tool_calls_false_gives_one_call(client: openai.OpenAI) -> None:
    model = _model(client)
    for seed in range(3):
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Weather in Paris, time in Tokyo, and 5 USD in JPY?"}],
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=150,
            seed=seed,
        ).choices[0]
        assert reply.finish_reason == "tool_calls"
        assert len(reply.message.tool_calls) == 1
        _validate(_calls(reply.message))


@pytest.mark.parametrize("choice", ["required", "named"])
def test_reply_cut_short_keeps_its_complete_calls_streamed_or_not(client: openai.OpenAI, choice: str) -> None:
    """A reply cut by max_tokens: the calls completed before the cut come back as tool_calls, the cut
    one is dropped (never leaked as content), finish_reason is "length", and the stream says the same."""
    tool_choice: Any = (
        "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    )
    messages = [{"role": "user", "content": "Weather in Paris and in Rome?"}]
    seen_calls = 0
    for max_tokens in (4, 12, 22, 30, 45):
        kwargs = {
            "model": _model(client),
            "messages": messages,
            "tools": TOOLS,
            "tool_choice": tool_choice,
            "max_tokens": max_tokens,
            "seed": 7,
            "temperature": 1.0,
        }
        reply = client.chat.completions.create(**kwargs).choices[0]
        calls = _calls(reply.message)
        content, streamed, finish = _stream(client, **kwargs)
        if reply.finish_reason == "length":
            assert reply.message.content is None, (max_tokens, reply.message.content)
        else:
            assert reply.finish_reason == "tool_calls" and calls
        if calls:
            _validate(calls)
        seen_calls += bool(calls) and reply.finish_reason == "length"
        assert (content, [(c["name"], json.loads(c["arguments"])) for c in streamed], finish) == (
            reply.message.content,
            calls,
            reply.finish_reason,
        ), max_tokens
    assert seen_calls or choice == "named", "no reply was cut after a complete call"


def test_history_with_calls_and_tool_results_is_rendered(client: openai.OpenAI, server: RemoteServer) -> None:
    messages = [
        {"role": "user", "content": "What's the weather in Rome?"},
        _call("call_9", "get_weather", {"city": "Rome"}),
        {"role": "tool", "tool_call_id": "call_9", "content": "Sunny, 25 C"},
    ]
    tokens = server.post("/tokenize", json={"messages": messages}).json()["tokens"]
    text = server.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in text
    assert "<tool_response>\nSunny, 25 C\n</tool_response>" in text
    reply = client.chat.completions.create(
        model=_model(client), messages=messages, tools=TOOLS, tool_choice="none", max_tokens=24, temperature=0
    ).choices[0]
    assert reply.message.content and not reply.message.tool_calls


def test_tool_errors_name_the_field(client: openai.OpenAI) -> None:
    model = _model(client)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"tool_choice": "required", "use_beam_search": True, "temperature": 0}, "use_beam_search"),
        (
            {
                "tool_choice": "required",
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}},
                    }
                ],
            },
            "tools",
        ),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=8,
                extra_body={"tools": TOOLS, **extra},
            )
        assert info.value.body["param"] == param, (extra, info.value.body)  # type: ignore[index]


# ------------------------------------------------------------------------------------ langchain


def test_langchain_bind_tools_returns_tool_calls(server: RemoteServer, client: openai.OpenAI) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return "sunny"

    llm = ChatOpenAI(
        model=_model(client),
        base_url=server.base_url + "/v1",
        api_key="unused",
        max_tokens=100,
        temperature=0,
    )
    reply = llm.bind_tools([get_weather], tool_choice="required").invoke("What's the weather in Paris?")
    assert reply.tool_calls, reply
    assert reply.tool_calls[0]["name"] == "get_weather"
    assert isinstance(reply.tool_calls[0]["args"].get("city"), str)
    streamed = llm.bind_tools([get_weather], tool_choice="get_weather").stream("What's the weather in Oslo?")
    merged = None
    for chunk in streamed:
        merged = chunk if merged is None else merged + chunk
    assert merged is not None and [c["name"] for c in merged.tool_calls] == ["get_weather"]


def test_langchain_structured_output_returns_a_valid_object(
    server: RemoteServer, client: openai.OpenAI
) -> None:
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=40)
        country: str = Field(max_length=40)
        is_capital: bool  # a number field lets this small model write digits until max_tokens

    llm = ChatOpenAI(
        model=_model(client),
        base_url=server.base_url + "/v1",
        api_key="unused",
        max_tokens=120,
        temperature=0,
    )
    for method in ("json_schema", "function_calling"):
        city = llm.with_structured_output(City, method=method).invoke("Describe Paris.")
        assert isinstance(city, City), (method, city)
