"""The tool plan of a chat request and the parsers of constrained (``required`` and named) replies."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.tool_calls import JsonArrayToolParser, NamedToolParser, plan_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], **fields})


def _plan(parser: str | None = "hermes", auto: bool = True, **fields: Any) -> Any:
    return plan_tools(_request(**fields), tool_parser=parser, enable_auto_tool_choice=auto)


def _error(**fields: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        _plan(**fields)
    return info.value


def test_modes_and_defaults() -> None:
    assert _plan().mode == "none"
    assert _plan(tools=[WEATHER], tool_choice="none").mode == "none"
    assert _plan(tools=[WEATHER], tool_choice="none").template_tools is None
    auto = _plan(tools=[WEATHER])
    assert auto.mode == "auto" and auto.constraint is None and auto.template_tools == [WEATHER]
    required = _plan(tools=[WEATHER, TIME], tool_choice="required")
    assert required.mode == "required" and required.constraint is not None and required.constraint.grammar
    named = _plan(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.mode == "named" and named.constraint is not None


def test_auto_needs_both_flags_and_others_do_not() -> None:
    for parser, auto in ((None, True), ("hermes", False), (None, False)):
        error = _error(parser=parser, auto=auto, tools=[WEATHER])
        assert error.param == "tool_choice"
        assert "--enable-auto-tool-choice" in error.message and "--tool-call-parser" in error.message
    assert _plan(parser=None, auto=False, tools=[WEATHER], tool_choice="required").mode == "required"


def test_bad_tool_fields_name_the_field() -> None:
    assert _error(tool_choice="required").param == "tool_choice"
    assert _error(tools=[WEATHER, WEATHER], tool_choice="required").param == "tools"
    named_other = {"type": "function", "function": {"name": "nope"}}
    assert _error(tools=[WEATHER], tool_choice=named_other).param == "tool_choice"
    with_format = {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}
    assert _error(**with_format).param == "response_format"
    bad_schema = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}},
    }
    assert _error(tools=[bad_schema], tool_choice="required").param == "tools"


CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {}), ("get_weather", {"city": 'Zürich "x" [}'})]


def _array_text(calls: list[tuple[str, dict[str, Any]]]) -> str:
    return json.dumps([{"name": n, "parameters": a} for n, a in calls], ensure_ascii=False)


def _stream(parser: Any, text: str, rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    content = ""
    calls: dict[int, list[str]] = {}
    pos = 0
    while pos < len(text):
        step = rng.randint(1, 7)
        pieces = [parser.feed(text[pos : pos + step])]
        pos += step
        if pos >= len(text):
            pieces.append(parser.finish())
        for delta in pieces:
            content += delta.content or ""
            for piece in delta.tool_calls:
                if piece.name is not None:
                    assert piece.index not in calls
                    calls[piece.index] = [piece.name, ""]
                if piece.arguments is not None:
                    calls[piece.index][1] += piece.arguments
    return content, [(n, a) for n, a in (calls[i] for i in sorted(calls))]


@pytest.mark.parametrize("count", [1, 2, 3])
def test_required_array_parser_complete_and_streamed_agree(count: int) -> None:
    text = _array_text(CALLS[:count])
    extracted = JsonArrayToolParser().extract(text)
    assert extracted.tools_called and extracted.content is None
    expected = [(n, json.dumps(a, ensure_ascii=False)) for n, a in CALLS[:count]]
    assert [(c.function.name, c.function.arguments) for c in extracted.tool_calls] == expected
    for seed in range(20):
        assert _stream(JsonArrayToolParser(), text, random.Random(seed)) == ("", expected)


@pytest.mark.parametrize(
    "text", ["", "[", "[]", '[{"name": "f", "parameters": {}}', '[{"name": "f"}] x', "{}"]
)
def test_required_array_parser_gives_unparsable_output_back_as_content(text: str) -> None:
    extracted = JsonArrayToolParser().extract(text)
    assert not extracted.tools_called and extracted.content == text


def test_named_parser() -> None:
    text = '{"city": "Paris"}'
    extracted = NamedToolParser("get_weather").extract(text)
    assert [(c.function.name, c.function.arguments) for c in extracted.tool_calls] == [("get_weather", text)]
    for seed in range(10):
        assert _stream(NamedToolParser("get_weather"), text, random.Random(seed)) == (
            "",
            [("get_weather", text)],
        )
    cut = '{"city": "Par'
    assert NamedToolParser("get_weather").extract(cut).content == cut
    # Cut by max_tokens: no call, and the fragment is not content either.
    truncated = NamedToolParser("get_weather").extract(cut, truncated=True)
    assert truncated.tool_calls == [] and truncated.content is None
    # The call goes out when its arguments are complete.
    streaming = NamedToolParser("get_weather")
    assert streaming.feed("{").tool_calls == []
    assert [(p.name, p.arguments) for p in streaming.feed('"city": "Paris"}').tool_calls] == [
        ("get_weather", None),
        (None, text),
    ]


def test_offline_chat_renders_tools(default_llm: Any, tool_llm: Any) -> None:
    from pagedllm import SamplingParams
    from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser

    llm = tool_llm
    prompt = llm.llm_engine.apply_chat_template([{"role": "user", "content": "Hi"}], tools=[WEATHER])
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    # The default model renders tools with the shipped template, as the engine given that template.
    assert (
        default_llm.llm_engine.apply_chat_template([{"role": "user", "content": "Hi"}], tools=[WEATHER])
        == prompt
    )
    few_shot = [
        {"role": "user", "content": "What's the weather in Rome?"},
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
        },
        {"role": "user", "content": "What's the weather in Oslo?"},
    ]
    [out] = llm.chat(few_shot, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False, tools=[WEATHER])
    calls = get_tool_parser("hermes")().extract(out.outputs[0].text)
    assert calls.tools_called and calls.tool_calls[0].function.name == "get_weather", out.outputs[0].text
    llm.llm_engine.check_idle()
