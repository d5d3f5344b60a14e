"""Tool-call parsers: each format's complete-output parsing, malformed output returned as content, and
streaming that adds up to exactly the complete-output result for every way of splitting the text."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.entrypoints.openai.tool_parsers import (
    DeltaMessage,
    ExtractedToolCalls,
    ToolParser,
    get_tool_parser,
    make_tool_call_id,
)


def _ids() -> itertools.count[int]:
    return itertools.count()


def parser(name: str) -> ToolParser:
    counter = _ids()
    return get_tool_parser(name)(id_factory=lambda: f"id{next(counter)}")


def calls(result: ExtractedToolCalls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in result.tool_calls]


def stream(
    name: str, pieces: list[str], truncated: bool = False
) -> tuple[str, list[tuple[str, str]], list[DeltaMessage]]:
    """Feeds ``pieces``; checks the delta protocol; returns content, ``(name, arguments)`` per call and
    the messages."""
    p = parser(name)
    messages = [p.feed(piece) for piece in pieces] + [p.finish(truncated)]
    content = "".join(m.content or "" for m in messages)
    names: list[str] = []
    ids: list[str] = []
    arguments: list[str] = []
    for delta in (d for m in messages for d in m.tool_calls):
        if delta.name is not None:
            assert delta.index == len(names) and delta.id is not None and delta.arguments is None
            names.append(delta.name)
            ids.append(delta.id)
            arguments.append("")
        else:
            assert delta.index == len(names) - 1 and delta.id is None and delta.arguments is not None
            arguments[delta.index] += delta.arguments
    assert len(set(ids)) == len(ids)
    return content, list(zip(names, arguments, strict=True)), messages


def chunks(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


# -- the texts every format must parse, with what they hold ----------------------------------------

WEATHER = {"city": "Zürich", "unit": "c"}
NESTED = {"filter": {"tags": ["a", "b"], "range": {"lo": -1, "hi": 2.5}}, "flag": True, "none": None}

VALID: dict[str, list[tuple[str, str | None, list[tuple[str, dict]]]]] = {
    "hermes": [
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}\n</tool_call>',
            None,
            [("get_weather", WEATHER)],
        ),
        (
            'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Z\\u00fcrich", "unit": "c"}}\n'
            '</tool_call>\n<tool_call>\n{"arguments": '
            + json.dumps(NESTED)
            + ', "name": "search"}\n</tool_call>\n',
            "Let me check. ",
            [("get_weather", WEATHER), ("search", NESTED)],
        ),
        (
            '<tool_call>{"name": "emoji", "arguments": {"s": "🌧 \\"<tool_call>\\" }{"}}</tool_call>',
            None,
            [("emoji", {"s": '🌧 "<tool_call>" }{'})],
        ),
        ('<tool_call>{"name": "noargs"}</tool_call>', None, [("noargs", {})]),
    ],
    "llama3_json": [
        (
            '{"name": "get_weather", "parameters": {"city": "Zürich", "unit": "c"}}',
            None,
            [("get_weather", WEATHER)],
        ),
        (
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Zürich", "unit": "c"}}; '
            '{"name": "search", "arguments": ' + json.dumps(NESTED) + "}",
            None,
            [("get_weather", WEATHER), ("search", NESTED)],
        ),
        ('  {"name": "q", "parameters": "{\\"s\\": \\"}{\\"}"}', None, [("q", {"s": "}{"})]),
    ],
    "mistral": [
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}]',
            None,
            [("get_weather", WEATHER)],
        ),
        (
            'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}, '
            '{"name": "search", "arguments": ' + json.dumps(NESTED) + "}]\n",
            "Sure. ",
            [("get_weather", WEATHER), ("search", NESTED)],
        ),
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich", "unit": "c"}[TOOL_CALLS]search[ARGS]'
            + json.dumps(NESTED),
            None,
            [("get_weather", WEATHER), ("search", NESTED)],
        ),
        ('text [TOOL_CALLS]a.b-c_1[ARGS]{"x": "[ARGS]"}', "text ", [("a.b-c_1", {"x": "[ARGS]"})]),
    ],
    "pythonic": [
        ('[get_weather(city="Zürich", unit="c")]', None, [("get_weather", WEATHER)]),
        (
            "[get_weather(city='Zürich', unit=\"c\"), search(filter={'tags': ['a', 'b'], 'range': {'lo': -1, "
            "'hi': 2.5}}, flag=True, none=None)]",
            None,
            [("get_weather", WEATHER), ("search", NESTED)],
        ),
        (
            '  [ f ( s=\'a)]\\\'(\', t="""x\'\'\'"y""", u=(1, +2)) , g(),]\n',
            None,
            [("f", {"s": "a)]'(", "t": "x'''\"y", "u": [1, 2]}), ("g", {})],
        ),
    ],
}

CASES = [
    (name, text, content, expected) for name, cases in VALID.items() for text, content, expected in cases
]
CASE_IDS = [f"{name}-{i}" for name, cases in VALID.items() for i in range(len(cases))]


@pytest.mark.parametrize(("name", "text", "content", "expected"), CASES, ids=CASE_IDS)
def test_extract(name: str, text: str, content: str | None, expected: list[tuple[str, dict]]) -> None:
    result = parser(name).extract(text)
    assert result.tools_called
    assert result.content == content
    assert calls(result) == expected
    for call in result.tool_calls:
        assert call.type == "function"
        assert call.function.arguments == json.dumps(json.loads(call.function.arguments), ensure_ascii=False)
        assert "\\u" not in call.function.arguments  # not ASCII-escaped


@pytest.mark.parametrize(("name", "text", "content", "expected"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("size", [1, 2, 3, 7, 10_000])
def test_streaming_equals_extract(
    name: str, text: str, content: str | None, expected: list[tuple[str, dict]], size: int
) -> None:
    result = parser(name).extract(text)
    streamed_content, streamed_calls, _ = stream(name, chunks(text, size))
    assert streamed_content == (result.content or "")
    assert streamed_calls == [(c.function.name, c.function.arguments) for c in result.tool_calls]


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=40))
def test_streaming_random_splits(case: tuple[str, str, str | None, list], cuts: list[int]) -> None:
    name, text, _, _ = case
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(points)]
    result = parser(name).extract(text)
    streamed_content, streamed_calls, _ = stream(name, pieces)
    assert streamed_content == (result.content or "")
    assert streamed_calls == [(c.function.name, c.function.arguments) for c in result.tool_calls]


def test_streaming_sends_content_early_and_a_call_once_it_is_complete() -> None:
    p = parser("hermes")
    assert p.feed("Hello <tool").content == "Hello "  # "<tool" may start a marker: held back
    assert p.feed("ing> there").content == "<tooling> there"
    assert p.feed(" <tool_call>").content == " "
    # The name is known here, but the call may still be cut or malformed: nothing is sent yet.
    assert p.feed('{"name": "get_weather", "argu').tool_calls == []
    assert p.feed('ments": {"city": "Paris"}}').tool_calls == []
    last = p.feed("</tool_call>")
    assert [(d.index, d.id, d.name, d.arguments) for d in last.tool_calls] == [
        (0, "id0", "get_weather", None),
        (0, None, None, '{"city": "Paris"}'),
    ]
    assert p.finish() == DeltaMessage()


def test_pythonic_call_is_streamed_at_its_closing_parenthesis() -> None:
    p = parser("pythonic")
    assert p.feed("[get_wea").tool_calls == []
    assert p.feed('ther(city="P').tool_calls == []
    pieces = p.feed('aris")]').tool_calls
    assert [(d.name, d.arguments) for d in pieces] == [("get_weather", None), (None, '{"city": "Paris"}')]


# Each format's second valid case cut inside its second call (as max_tokens cuts a reply): the first
# call is kept, the cut one dropped, and nothing of it comes back as content.
CUT = {
    "hermes": VALID["hermes"][1],
    "llama3_json": VALID["llama3_json"][1],
    "mistral": VALID["mistral"][1],
    "pythonic": VALID["pythonic"][1],
}


@pytest.mark.parametrize("name", sorted(CUT))
def test_a_reply_cut_in_its_tool_region_keeps_its_complete_calls(name: str) -> None:
    text, content, expected = CUT[name]
    second = text.rindex("search")
    for end in range(second - 2, len(text) - 3, 7):
        cut = text[:end]
        extracted = parser(name).extract(cut, truncated=True)
        assert extracted.tools_called and calls(extracted) == expected[:1], cut
        assert extracted.content == content, cut
        for size in (1, 3, 11):
            streamed_content, streamed, _ = stream(name, chunks(cut, size), truncated=True)
            assert streamed_content == (content or ""), cut
            assert [(n, json.loads(a)) for n, a in streamed] == expected[:1], cut
        # Not cut by max_tokens, the same text is malformed: all of it is content.
        assert parser(name).extract(cut).content == cut


def test_a_reply_cut_before_its_first_call_completes_has_neither_calls_nor_the_fragment() -> None:
    cut = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city'
    extracted = parser("hermes").extract(cut, truncated=True)
    assert not extracted.tools_called and extracted.tool_calls == [] and extracted.content == "Let me check. "
    assert stream("hermes", chunks(cut, 5), truncated=True)[:2] == ("Let me check. ", [])


MALFORMED: dict[str, list[str]] = {
    "hermes": [
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',  # JSON missing a brace
        '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        'hi <tool_call>{"name": "f", "arguments": {"a": 1}}',  # unclosed
        '<tool_call>{"name": "f", "arguments": {}}</tool_call> and then some text',
        '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>oops</tool_call>',
        '<tool_call>{"name": "f", "name": "g", "arguments": {}}</tool_call>',  # the streamed name changes
    ],
    "llama3_json": [
        '{"answer": 42}',
        '{"name": "f", "parameters": {"a": 1}',
        '{"name": "f", "parameters": {}} trailing',
        "<|python_tag|>",
        '<|python_tag|>print("hi")',
        '{"name": "f", "parameters": {"a": NaN-ish}}',
    ],
    "mistral": [
        "[TOOL_CALLS]",
        "[TOOL_CALLS][]",
        '[TOOL_CALLS][{"name": "f", "arguments": {}}',
        '[TOOL_CALLS][{"name": "f", "arguments": {}},]',
        '[TOOL_CALLS][{"name": "f", "arguments": {}}] and more',
        '[TOOL_CALLS][{"arguments": {}}]',
        "[TOOL_CALLS]bad name[ARGS]{}",
        '[TOOL_CALLS]f[ARGS]{"a": 1',
        "[TOOL_CALLS]f[ARGS][1]",
    ],
    "pythonic": [
        "[f(1)]",  # positional
        "[f(**kw)]",
        "[f(a=b)]",  # a name, not a literal
        "[f(a=__import__('os').system('echo hi'))]",
        "[f(a=1+2)]",
        "[f(a=f'{x}')]",
        "[f(a=b'x')]",
        "[f(a={1: 2})]",
        "[f(a=1e999)]",
        "[f(a=1)",
        "[f(a=1)] tail",
        "[f(a=1) g()]",
        "[os.system(a=1)]",
    ],
}


@pytest.mark.parametrize(
    ("name", "text"), [(n, t) for n, texts in MALFORMED.items() for t in texts], ids=lambda v: str(v)[:40]
)
def test_malformed_is_content(name: str, text: str) -> None:
    assert parser(name).extract(text) == ExtractedToolCalls(tools_called=False, tool_calls=[], content=text)
    for size in (1, 3, len(text)):
        content, _, messages = stream(name, chunks(text, size))
        arguments = [d.arguments for m in messages for d in m.tool_calls if d.arguments is not None]
        if not arguments:  # nothing was sent as a call: all of it arrives as content
            assert content == text


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("hermes", "Just an answer with <b>markup</b> and < signs <tool_cal"),
        ("llama3_json", "The answer is {1, 2}"),
        ("llama3_json", "<|python"),
        ("mistral", "No tools [TOOL_CALL"),
        ("pythonic", "[1, 2, 3]"),
        ("pythonic", "[get_weather"),
        ("pythonic", "Call get_weather(city='Paris')"),
        ("hermes", ""),
    ],
)
def test_plain_text_is_content(name: str, text: str) -> None:
    assert parser(name).extract(text) == ExtractedToolCalls(tools_called=False, tool_calls=[], content=text)
    for size in (1, 2, 7):
        content, streamed_calls, _ = stream(name, chunks(text, size))
        assert content == text and streamed_calls == []


def test_plain_text_streams_before_the_end() -> None:
    p = parser("llama3_json")
    assert p.feed("  ").content is None  # may still become a call
    assert p.feed("The").content == "  The"
    p = parser("pythonic")
    assert p.feed("[").content is None
    assert p.feed("1").content == "[1"


def test_streaming_after_a_good_call_keeps_it_and_sends_the_rest_as_content() -> None:
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call> oops'
    content, streamed_calls, _ = stream("hermes", chunks(text, 4))
    assert streamed_calls == [("f", "{}")]
    assert content == " oops"


def test_feed_after_finish_raises_and_finish_is_idempotent() -> None:
    p = parser("hermes")
    assert p.feed("<tool").content is None
    assert p.finish().content == "<tool"
    assert p.finish() == DeltaMessage()
    with pytest.raises(RuntimeError):
        p.feed("y")


def test_extract_leaves_streaming_state_alone() -> None:
    p = parser("mistral")
    assert p.feed("a [TOOL_").content == "a "
    assert p.extract('[TOOL_CALLS][{"name": "f", "arguments": {}}]').tools_called
    assert p.feed("CALLS]f[ARGS]{}").tool_calls[0].name == "f"


def test_default_ids() -> None:
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", make_tool_call_id())
    result = get_tool_parser("hermes")().extract(VALID["hermes"][1][0])
    ids = [c.id for c in result.tool_calls]
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids) and len(set(ids)) == 2


def test_registry() -> None:
    assert [get_tool_parser(n).name for n in ("hermes", "llama3_json", "mistral", "pythonic")] == [
        "hermes",
        "llama3_json",
        "mistral",
        "pythonic",
    ]
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, pythonic"):
        get_tool_parser("qwen")
