"""Reasoning parsers: each format's split of a complete output, and streaming that adds up to exactly
the complete-output split for every way of cutting the text into pieces."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.entrypoints.openai.reasoning_parsers import (
    ExtractedReasoning,
    ReasoningDelta,
    ReasoningParser,
    get_reasoning_parser,
)

NAMES = ["deepseek_r1", "qwen3"]


def reference(name: str, text: str, opened: bool = False) -> tuple[str | None, str | None]:
    """The rules of the two formats, written directly (``opened``: the prompt ends with <think>)."""
    stripped = text.lstrip()
    tagged = stripped.startswith("<think>")
    if name == "deepseek_r1" or tagged or opened:
        body = stripped[len("<think>") :] if tagged else text
        if "</think>" in body:
            reasoning, _, content = body.partition("</think>")
            return reasoning or None, content or None
        return body or None, None
    return None, text or None


def stream(
    name: str, pieces: list[str], opened: bool = False
) -> tuple[str | None, str | None, list[ReasoningDelta]]:
    """Feeds ``pieces``; returns the joined reasoning and content (``None`` when empty) and the deltas."""
    parser = get_reasoning_parser(name)(opened)
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    for delta in deltas:
        assert delta.reasoning_content != "" and delta.content != ""  # nothing: None, not ""
    reasoning = "".join(d.reasoning_content or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    return reasoning or None, content or None, deltas


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c for c in cuts if 0 <= c <= len(text))})
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)]


# (text, deepseek_r1 split, qwen3 split)
CASES: list[tuple[str, tuple[str | None, str | None], tuple[str | None, str | None]]] = [
    (
        "<think>\nLet me add.\n</think>\n\n2 + 2 = 4.",
        ("\nLet me add.\n", "\n\n2 + 2 = 4."),
        ("\nLet me add.\n", "\n\n2 + 2 = 4."),
    ),
    ("Let me add.</think>4", ("Let me add.", "4"), (None, "Let me add.</think>4")),
    ("Just the answer: 4", ("Just the answer: 4", None), (None, "Just the answer: 4")),
    ("  <think>cut off while thinking", ("cut off while thinking", None), ("cut off while thinking", None)),
    ("<think></think>Answer", (None, "Answer"), (None, "Answer")),
    ("<think>a</think>b</think>c", ("a", "b</think>c"), ("a", "b</think>c")),
    ("x <think>y</think>z", ("x <think>y", "z"), (None, "x <think>y</think>z")),
    ("4 < 5 and </thin", ("4 < 5 and </thin", None), (None, "4 < 5 and </thin")),
    ("", (None, None), (None, None)),
    ("<thi", ("<thi", None), (None, "<thi")),
]


@pytest.mark.parametrize(("text", "r1", "qwen3"), CASES)
def test_complete_outputs(
    text: str, r1: tuple[str | None, str | None], qwen3: tuple[str | None, str | None]
) -> None:
    for name, want in (("deepseek_r1", r1), ("qwen3", qwen3)):
        assert reference(name, text) == want, name  # the table agrees with the rules
        got = get_reasoning_parser(name)().extract(text)
        assert got == ExtractedReasoning(*want), name
        # One character at a time, and all at once.
        assert stream(name, list(text))[:2] == want, name
        assert stream(name, [text])[:2] == want, name
    # After a prompt that opened the reasoning, both formats read an untagged output alike.
    opened = get_reasoning_parser("qwen3")(prompt_opens_reasoning=True)
    assert (
        opened.extract(text)
        == ExtractedReasoning(*reference("qwen3", text, opened=True))
        == ExtractedReasoning(*r1)
    )
    assert stream("qwen3", list(text), opened=True)[:2] == r1


def test_streaming_holds_back_only_what_is_undecided() -> None:
    r1 = get_reasoning_parser("deepseek_r1")()
    assert r1.feed(" ") == ReasoningDelta()  # could still open with <think>
    assert r1.feed("<thi") == ReasoningDelta()
    assert r1.feed("nk>Hmm") == ReasoningDelta(reasoning_content="Hmm")
    assert r1.feed(", so </th") == ReasoningDelta(reasoning_content=", so ")  # "</th" is held back
    assert not r1.reasoning_ended
    assert r1.feed("ink>") == ReasoningDelta()
    assert r1.reasoning_ended
    assert r1.feed("Four.") == ReasoningDelta(content="Four.")
    assert r1.finish() == ReasoningDelta()

    # A held-back "</" that turns out not to be the tag is sent with the next piece.
    r1 = get_reasoning_parser("deepseek_r1")()
    assert r1.feed("a </") == ReasoningDelta(reasoning_content="a ")
    assert r1.feed("b>") == ReasoningDelta(reasoning_content="</b>")
    assert r1.finish() == ReasoningDelta()

    # Qwen3 output that does not open with <think> is content, streamed at once; after a prompt that
    # opened the reasoning it is reasoning up to </think>.
    qwen = get_reasoning_parser("qwen3")()
    assert not qwen.starts_in_reasoning
    assert qwen.feed("Plain") == ReasoningDelta(content="Plain")
    assert qwen.feed(" text</think>") == ReasoningDelta(content=" text</think>")
    assert qwen.finish() == ReasoningDelta()
    qwen = get_reasoning_parser("qwen3")(prompt_opens_reasoning=True)
    assert qwen.starts_in_reasoning
    assert qwen.feed("Thought") == ReasoningDelta(reasoning_content="Thought")
    assert qwen.feed("</think>Answer") == ReasoningDelta(content="Answer")
    assert qwen.reasoning_ended
    # A tagged Qwen3 output streams its reasoning at once.
    qwen = get_reasoning_parser("qwen3")()
    assert qwen.feed("<think>Thought") == ReasoningDelta(reasoning_content="Thought")


def test_registry_and_misuse() -> None:
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'; known: deepseek_r1, qwen3"):
        get_reasoning_parser("nope")
    parser: ReasoningParser = get_reasoning_parser("qwen3")()
    assert (parser.start, parser.end, parser.name) == ("<think>", "</think>", "qwen3")
    parser.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        parser.feed("x")
    with pytest.raises(RuntimeError, match="twice"):
        parser.finish()
    # extract leaves a streaming parser's state alone.
    streaming = get_reasoning_parser("deepseek_r1")()
    streaming.feed("partial")
    assert streaming.extract("a</think>b") == ExtractedReasoning("a", "b")
    assert streaming.feed(" more") == ReasoningDelta(reasoning_content=" more")


# Texts made of pieces that form, break and repeat the tags.
FRAGMENTS = ["<think>", "</think>", "<", "</", "<th", "</th", "ink>", ">", "think", " ", "\n", "a", "é", "4"]
texts = st.lists(st.sampled_from(FRAGMENTS), max_size=14).map("".join)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=300, deadline=None)
@given(text=texts, cuts=st.lists(st.integers(min_value=0, max_value=120), max_size=12))
def test_streaming_equals_complete_for_every_split(name: str, text: str, cuts: list[int]) -> None:
    want = reference(name, text)
    assert get_reasoning_parser(name)().extract(text) == ExtractedReasoning(*want)
    reasoning, content, deltas = stream(name, split(text, cuts))
    assert (reasoning, content) == want
    # Reasoning is never sent after content.
    kinds = [kind for d in deltas for kind, part in (("r", d.reasoning_content), ("c", d.content)) if part]
    assert kinds == sorted(kinds, reverse=True)
