"""The Responses API (``POST /v1/responses``) end to end: a real server with the shipped Hermes tool
template for SmolLM2 and the official ``openai`` client (``client.responses.create``,
``client.responses.stream``, ``stream=True``).

A Responses request is answered by the chat handler, so a greedy request must give exactly the text
of the equivalent chat completion; streamed events must come in OpenAI's order, number themselves
0, 1, 2, ... and end with the output of the same request answered at once. The stream translation is
also driven directly with chat chunks that carry reasoning, which this server's model does not write.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from helpers.server import RemoteServer
from pagedllm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagedllm.entrypoints.openai.responses_output import (
    ResponseTemplate,
    StreamTranslator,
    response_from_chat,
)

QUESTION = "Name three colours of the rainbow."
COUNTING = "Count from 1 to 1000, separated by commas."  # greedy: a reply of over 100 tokens

WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
}
TIME_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 40}},
    "required": ["zone"],
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": WEATHER_PARAMETERS,
        "strict": False,
    },
    {
        "type": "function",
        "name": "get_time",
        "description": "Local time in a zone",
        "parameters": TIME_PARAMETERS,
    },
]
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
# The same tools in the chat form.
CHAT_TOOLS = [
    {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}} for tool in TOOLS
]

# The event types of a streamed text reply, in order (the deltas collapsed into one).
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
CALL_EVENTS = [
    "response.output_item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
]


@pytest.fixture(scope="module")
def server(tool_server: RemoteServer) -> Iterator[RemoteServer]:
    yield tool_server
    tool_server.wait_idle()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _chat_text(client: openai.OpenAI, model: str, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return client.chat.completions.create(model=model, messages=messages, temperature=0, **kwargs).choices[0]  # type: ignore[arg-type]


def _without_ids(output: list[Any]) -> list[dict[str, Any]]:
    """Output items as dicts without their random ids (item ids and call ids)."""
    items = []
    for item in output:
        body = item if isinstance(item, dict) else item.model_dump(exclude_none=True)
        items.append({k: v for k, v in body.items() if k not in ("id", "call_id")})
    return items


def _collapse(types: list[str]) -> list[str]:
    """Event types with runs of the same delta type collapsed into one."""
    out: list[str] = []
    for t in types:
        if not (out and out[-1] == t and t.endswith(".delta")):
            out.append(t)
    return out


def _events(client: openai.OpenAI, **kwargs: Any) -> list[Any]:
    return list(client.responses.create(stream=True, **kwargs))


def _check_sequence(events: list[Any]) -> None:
    assert [e.sequence_number for e in events] == list(range(len(events)))
    ids = {e.response.id for e in events if hasattr(e, "response")}
    assert len(ids) == 1, ids


# ------------------------------------------------------------------------------------------ plain text


def test_plain_text_is_the_chat_completions_text(client: openai.OpenAI, model: str) -> None:
    response = client.responses.create(model=model, input=QUESTION, max_output_tokens=24, temperature=0)
    chat = _chat_text(client, model, [{"role": "user", "content": QUESTION}], max_completion_tokens=24)
    assert response.output_text == chat.message.content and response.output_text
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == model and response.store is True and response.previous_response_id is None
    assert response.max_output_tokens == 24 and response.temperature == 0.0
    assert response.tools == [] and response.tool_choice == "auto" and response.text.format.type == "text"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"]
    assert response.status == ("incomplete" if chat.finish_reason == "length" else "completed")
    usage = response.usage
    assert usage is not None and usage.output_tokens_details.reasoning_tokens == 0
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 24
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_instructions_and_input_items_are_the_chat_messages(client: openai.OpenAI, model: str) -> None:
    instructions = "You are a pirate. Answer in one short sentence."
    response = client.responses.create(
        model=model, instructions=instructions, input=QUESTION, max_output_tokens=24, temperature=0
    )
    messages = [{"role": "system", "content": instructions}, {"role": "user", "content": QUESTION}]
    chat = _chat_text(client, model, messages, max_completion_tokens=24)
    assert response.output_text == chat.message.content
    assert response.instructions == instructions
    # A conversation as items: the short form, typed messages with text parts, an assistant turn.
    items: list[Any] = [
        {"role": "user", "content": "Hi!"},
        # An output item sent back, with OpenAI's null fields.
        {
            "type": "message",
            "id": "msg_1",
            "status": "completed",
            "role": "assistant",
            "phase": None,
            "content": [{"type": "output_text", "text": "Hello.", "annotations": [], "logprobs": None}],
        },
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
    ]
    response = client.responses.create(
        model=model, instructions=instructions, input=items, max_output_tokens=24, temperature=0
    )
    chat = _chat_text(
        client,
        model,
        [
            messages[0],
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."},
            messages[1],
        ],
        max_completion_tokens=24,
    )
    assert response.output_text == chat.message.content


# ------------------------------------------------------------------------------------------ structured


def test_text_format_json_schema_gives_valid_json(client: openai.OpenAI, model: str) -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "enum": ["France", "Italy", "Japan"]},
            "millions": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["city", "country", "millions"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=model,
        input="Describe Paris as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
        max_output_tokens=80,
        temperature=0,
    )
    assert response.status == "completed", response.output_text
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema" and response.text.format.schema_ == schema

    class City(BaseModel):
        name: str = Field(max_length=30)
        country: str = Field(max_length=30)

    parsed = client.responses.parse(
        model=model, input="Describe Rome.", text_format=City, max_output_tokens=60, temperature=0
    )
    assert isinstance(parsed.output_parsed, City)


# ------------------------------------------------------------------------------------------ tools


def test_function_tools_then_their_outputs_in_a_second_turn(client: openai.OpenAI, model: str) -> None:
    question = {"role": "user", "content": "What's the weather in Paris, and the time in Tokyo?"}
    ask: dict[str, Any] = {"model": model, "input": [question], "tools": TOOLS, "temperature": 0}
    # One call per reply: allowed a list, SmolLM2-135M repeats calls until max_output_tokens.
    first = client.responses.create(
        **ask, tool_choice="required", parallel_tool_calls=False, max_output_tokens=120
    )
    named = client.responses.create(
        **ask, tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=60
    )
    assert first.status == named.status == "completed"
    assert [item.type for item in first.output + named.output] == ["function_call"] * 2
    calls: list[Any] = [*first.output, *named.output]
    assert calls[1].name == "get_time" and named.tool_choice.name == "get_time"  # type: ignore[union-attr]
    for call in calls:
        assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    # The calls go back as the SDK objects themselves, each answered by a function_call_output item.
    outputs = [
        {"type": "function_call_output", "call_id": c.call_id, "output": f"result {i}"}
        for i, c in enumerate(calls)
    ]
    second = client.responses.create(
        model=model,
        input=[question, *calls, *outputs],
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=24,
        temperature=0,
    )
    assert [item.type for item in second.output] == ["message"] and second.output_text
    # The same turn as chat messages: one assistant message with both calls, then one tool message each.
    history = [
        question,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ],
        },
        *({"role": "tool", "tool_call_id": o["call_id"], "content": o["output"]} for o in outputs),
    ]
    chat = _chat_text(client, model, history, tools=CHAT_TOOLS, tool_choice="none", max_completion_tokens=24)
    assert second.output_text == chat.message.content


# ------------------------------------------------------------------------------------------ streaming


def test_streamed_text_events_in_order_and_equal_to_the_whole(client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = {"model": model, "input": QUESTION, "max_output_tokens": 24, "temperature": 0}
    whole = client.responses.create(**kwargs)
    events = _events(client, **kwargs)
    _check_sequence(events)
    terminal = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert _collapse([e.type for e in events]) == [*TEXT_EVENTS, terminal]
    assert events[0].response.status == events[1].response.status == "in_progress"
    assert events[0].response.output == []
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    done = next(e for e in events if e.type == "response.output_text.done")
    item_id = events[2].item.id
    assert all(d.item_id == item_id and d.output_index == 0 and d.content_index == 0 for d in deltas)
    assert "".join(d.delta for d in deltas) == done.text == whole.output_text
    final = events[-1].response
    assert final.status == whole.status and final.usage is not None and whole.usage is not None
    # The counts (not cached_tokens: the second request finds the first one's prompt blocks cached).
    counts = ("input_tokens", "output_tokens", "total_tokens")
    assert [getattr(final.usage, k) for k in counts] == [getattr(whole.usage, k) for k in counts]
    assert _without_ids(final.output) == _without_ids(whole.output)
    assert final.output[0].id == item_id == events[-2].item.id
    # The SDK's stream helper reads the same events.
    helper_kwargs = {**kwargs, "max_output_tokens": 200}
    with client.responses.stream(**helper_kwargs) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final_response = stream.get_final_response()
    assert text == final_response.output_text == client.responses.create(**helper_kwargs).output_text


def test_streamed_function_calls_equal_the_whole(client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = {
        "model": model,
        "input": "Weather in Paris and time in Tokyo?",
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 120,
        "temperature": 0,
    }
    whole = client.responses.create(**kwargs)
    events = _events(client, **kwargs)
    _check_sequence(events)
    types = _collapse([e.type for e in events])
    calls = len(whole.output)
    assert whole.output and all(item.type == "function_call" for item in whole.output)
    assert types == ["response.created", "response.in_progress", *CALL_EVENTS * calls, "response.completed"]
    for index in range(calls):
        added = next(e for e in events if e.type == "response.output_item.added" and e.output_index == index)
        deltas = [
            e.delta
            for e in events
            if e.type == "response.function_call_arguments.delta" and e.output_index == index
        ]
        done = next(
            e for e in events if e.type == "response.function_call_arguments.done" and e.output_index == index
        )
        assert added.item.name == whole.output[index].name and added.item.arguments == ""  # type: ignore[union-attr]
        assert "".join(deltas) == done.arguments == whole.output[index].arguments  # type: ignore[union-attr]
    assert _without_ids(events[-1].response.output) == _without_ids(whole.output)


def test_max_output_tokens_makes_an_incomplete_response(client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = {
        "model": model,
        "input": "Write a long story about a dragon.",
        "max_output_tokens": 5,
        "temperature": 0,
    }
    response = client.responses.create(**kwargs)
    assert response.status == "incomplete"
    assert (
        response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    )
    assert response.usage is not None and response.usage.output_tokens == 5
    assert [(item.type, item.status) for item in response.output] == [("message", "incomplete")]  # type: ignore[union-attr]
    events = _events(client, **kwargs)
    _check_sequence(events)
    assert events[-1].type == "response.incomplete"
    assert _without_ids(events[-1].response.output) == _without_ids(response.output)
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_a_stream_cut_by_the_client_aborts_its_request(
    server: RemoteServer, client: openai.OpenAI, model: str
) -> None:
    before = server.wait_idle()
    stream = client.responses.create(
        model=model, input=COUNTING, max_output_tokens=600, temperature=0, stream=True
    )
    deltas = 0
    for event in stream:
        deltas += event.type == "response.output_text.delta"
        if deltas == 3:
            break
    assert server.metrics()["pagedllm:num_requests_running"] == 1
    stream.close()
    after = server.wait_idle(timeout=5)
    generated = after["pagedllm:generation_tokens_total"] - before["pagedllm:generation_tokens_total"]
    assert generated < 50, generated


# ------------------------------------------------------------------------------------------ refusals


def _user(text: str = "Hi") -> dict[str, Any]:
    return {"role": "user", "content": text}


def _call(call_id: str = "call_1", arguments: str = '{"city": "Rome"}') -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": arguments}


def test_truncation_auto_drops_the_oldest_items_until_the_input_fits(
    client: openai.OpenAI, model: str
) -> None:
    """Five ~300-token turns do not fit the 1,024-token context: refused as they are; with
    ``truncation: "auto"`` the oldest are left out (the instructions stay) and the reply comes."""
    turns: list[Any] = []
    for i in range(5):
        turns.append(_user(f"Note {i}: " + "alpha beta gamma delta " * 75))
        turns.append({"role": "assistant", "content": f"Noted {i}."})
    turns.append(_user("Say OK."))
    kwargs: dict[str, Any] = {
        "model": model,
        "instructions": "You are terse.",
        "input": turns,
        "max_output_tokens": 16,
    }
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**kwargs)
    assert info.value.body["param"] == "input"  # type: ignore[index]
    response = client.responses.create(**kwargs, truncation="auto")
    assert response.status in ("completed", "incomplete") and response.truncation == "auto"
    assert response.usage is not None and 16 < response.usage.input_tokens <= 1024 - 16
    assert response.instructions == "You are terse."


REFUSALS: list[Any] = [
    pytest.param({"background": True, "store": False}, "background", id="background-unstored"),
    pytest.param({"conversation": "conv_1"}, "conversation", id="conversation"),
    pytest.param({"include": ["reasoning.encrypted_content"]}, "include", id="include"),
    pytest.param({"reasoning": {"effort": "high"}}, "reasoning.effort", id="reasoning-effort"),
    pytest.param({"reasoning": {"summary": "auto"}}, "reasoning.summary", id="reasoning-summary"),
    pytest.param({"text": {"verbosity": "low"}}, "text.verbosity", id="text-verbosity"),
    pytest.param({"max_tool_calls": 2}, "max_tool_calls", id="max_tool_calls"),
    pytest.param({"service_tier": "flex"}, "service_tier", id="service_tier"),
    pytest.param({"prompt": {"id": "p"}, "top_logprobs": 2}, "prompt", id="prompt-template"),
    pytest.param({"modalities": ["text"]}, "modalities", id="unknown-field"),
    pytest.param({"temperature": -1}, "temperature", id="temperature"),
    pytest.param({"max_output_tokens": 0}, "max_output_tokens", id="max_output_tokens-zero"),
    pytest.param({"max_output_tokens": 10**6}, "input", id="max_output_tokens-over-context"),
    pytest.param({"input": 5}, "input", id="input-number"),
    pytest.param({"input": []}, "input", id="input-empty"),
    pytest.param({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", id="item_reference"),
    pytest.param(
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
        "input",
        id="input_image",
    ),
    pytest.param(
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
        "input",
        id="input_file",
    ),
    pytest.param(
        {"input": [_user(), {"role": "user", "content": "Hi", "name": "x"}]}, "input[1].name", id="item-extra"
    ),
    pytest.param(
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi", "x": 1}]}]},
        "input[0].content[0].x",
        id="part-extra",
    ),
    pytest.param({"text": {"format": {"type": "text", "x": 1}}}, "text.format.x", id="format-extra"),
    pytest.param(
        {"input": [_user(), {"type": "function_call_output", "call_id": "call_9", "output": "1"}]},
        "input[1].call_id",
        id="output-without-call",
    ),
    pytest.param(
        {"instructions": "Be brief.", "input": [_user(), _call(arguments="not json")], "tool_choice": "none"},
        "input[1]",
        id="call-arguments-not-json",
    ),
    pytest.param(
        {
            "input": [
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "x"}]},
                _user(),
            ]
        },
        "input[0]",
        id="reasoning-before-user",
    ),
    pytest.param({"tools": [{"type": "web_search"}]}, "tools", id="web_search"),
    pytest.param({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools", id="file_search"),
    pytest.param(
        {"tools": [{"type": "code_interpreter", "container": "auto"}]}, "tools", id="code_interpreter"
    ),
    pytest.param({"tools": [{"type": "mcp", "server_label": "s"}]}, "tools", id="mcp"),
    pytest.param({"tools": [{"type": "image_generation"}]}, "tools", id="image_generation"),
    pytest.param({"tools": [{"type": "computer_use_preview"}]}, "tools", id="computer_use"),
    pytest.param(
        {
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}],
            "tool_choice": "required",
        },
        "tools[0].parameters",
        id="tool-parameters-not-object",
    ),
    pytest.param(
        {"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
        "tool_choice",
        id="tool_choice-undeclared",
    ),
    pytest.param(
        {"tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
        "text.format",
        id="text-format-with-required-tools",
    ),
    pytest.param({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", id="tool_choice-built-in"),
    pytest.param(
        {"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", id="json_schema-without-schema"
    ),
    # One rule with /v1/completions' prompt: nothing to answer is a 400.
    pytest.param({"input": ""}, "input", id="input-empty-text"),
    pytest.param({"input": []}, "input", id="input-no-items"),
]


@pytest.mark.parametrize(("fields", "param"), REFUSALS)
def test_refused_with_a_400_naming_the_field(
    server: RemoteServer, fields: dict[str, Any], param: str
) -> None:
    body = {"input": "Hi", "max_output_tokens": 4, **fields}
    r = server.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"], error


def test_unknown_model_is_a_404_and_refusals_reach_no_engine(
    server: RemoteServer, client: openai.OpenAI
) -> None:
    before = server.wait_idle()
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="gpt-4o", input="Hi")
    assert info.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="x", input="Hi", previous_response_id="resp_1")
    assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]
    r = httpx.post(
        server.url("/v1/responses"), json={"input": "Hi", "background": True, "stream": True}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    after = server.wait_idle()
    assert after["pagedllm:prompt_tokens_total"] == before["pagedllm:prompt_tokens_total"]


# ------------------------------------------------------------------------------------------ translation


def _template(**fields: Any) -> ResponseTemplate:
    request = ResponsesRequest.model_validate({"input": "x", **fields})
    return ResponseTemplate(id="resp_t", created_at=0, model="m", request=request, temperature=1.0, top_p=1.0)


def _chunk(delta: dict[str, Any], finish: str | None = None) -> str:
    return json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "usage": None})


def _parse_events(stream: list[str]) -> list[dict[str, Any]]:
    events = []
    for text in stream:
        kind, data = text.split("\n")[:2]
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        events.append(event)
    return events


def _translate(chunks: list[str]) -> list[dict[str, Any]]:
    translator = StreamTranslator(_template(), lambda p: "max_output_tokens" if p == "max_tokens" else p)
    return _parse_events([event for chunk in chunks for event in translator.feed(chunk)])


USAGE = {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16}
CALL = {"id": "call_a", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}


@pytest.mark.parametrize("finish", ["tool_calls", "length"])
def test_stream_of_reasoning_content_and_calls_ends_with_the_whole_output(finish: str) -> None:
    """Chat chunks with reasoning, content and (unless cut by length) a tool call: the events open a
    reasoning item, then the message, then the call, and end with what ``response_from_chat`` makes
    of the same reply."""
    calls = [CALL] if finish == "tool_calls" else []
    chunks = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"reasoning_content": "Think"}),
        _chunk({"reasoning_content": "ing."}),
        _chunk({"content": "Let me "}),
        _chunk({"content": "check."}),
        *(
            _chunk(
                {
                    "tool_calls": [
                        {"index": 0, "id": c["id"], "type": "function", "function": {"name": "get_time"}}
                    ]
                }
            )
            for c in calls
        ),
        *(
            _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"zone": "CET"}'}}]})
            for c in calls
        ),
        _chunk({}, finish),
        json.dumps({"choices": [], "usage": USAGE}),
        "[DONE]",
    ]
    events = _translate(chunks)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [
        (e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.added"
    ]
    kinds = ["reasoning", "message", "function_call"][: 2 + len(calls)]
    assert added == list(enumerate(kinds))
    # The reasoning closes as the message opens; the message stays open until the end.
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert done == list(range(len(kinds)))
    assert events.index(next(e for e in events if e["type"] == "response.output_item.done")) < events.index(
        next(e for e in events if e["type"] == "response.output_text.delta")
    )
    reasoning = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(reasoning) == "Thinking."
    message = {"content": "Let me check.", "reasoning_content": "Thinking.", "tool_calls": calls}
    body = {"choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": USAGE}
    whole = response_from_chat(_template(), body).model_dump(mode="json")
    final = events[-1]["response"]
    assert events[-1]["type"] == ("response.completed" if calls else "response.incomplete")
    assert _without_ids(final["output"]) == _without_ids(whole["output"])
    assert final["usage"] == whole["usage"] and final["usage"]["input_tokens"] == 7
    statuses = ["completed"] * 3 if calls else ["completed", "incomplete"]
    assert [item["status"] for item in final["output"]] == statuses


def test_stream_error_becomes_an_error_event_naming_the_request_field() -> None:
    error = {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "max_tokens", "code": None}
    }
    events = _translate([_chunk({"content": "a"}), json.dumps(error), "[DONE]"])
    assert events[-1] == {
        "type": "error",
        "sequence_number": len(events) - 1,
        "code": None,
        "message": "bad",
        "param": "max_output_tokens",
    }
    assert not any(e["type"].startswith("response.completed") for e in events)


def test_empty_reply_is_one_empty_message_streamed_or_not() -> None:
    events = _translate([_chunk({"role": "assistant", "content": ""}, "stop"), "[DONE]"])
    whole = response_from_chat(
        _template(), {"choices": [{"message": {"content": ""}, "finish_reason": "stop"}]}
    )
    assert _without_ids(events[-1]["response"]["output"]) == _without_ids(
        whole.model_dump(mode="json")["output"]
    )
    assert whole.output[0].type == "message" and whole.output[0].content[0].text == ""  # type: ignore[union-attr]
