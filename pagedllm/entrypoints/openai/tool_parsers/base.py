"""The shared part of the tool-call parsers: the OpenAI-shaped results and the streaming engine.

A parser turns a model's generated text into OpenAI ``tool_calls``, either all at once
(:meth:`ToolParser.extract`) or incrementally while the text streams in (:meth:`ToolParser.feed`, then
:meth:`ToolParser.finish`). Both run the same code: ``extract`` feeds the whole text to a fresh parser,
so for well-formed output the streamed pieces add up to exactly what ``extract`` returns.

The rules every format follows:

* The output is *content*, then optionally a *tool region* that starts at a format-specific marker.
  The tool region holds one or more calls and nothing else but the format's separators and
  whitespace. Content is streamed as it arrives, except a tail that may be the start of the marker,
  which is held back until it is decided.
* ``arguments`` is always a JSON object serialised by ``json.dumps(..., ensure_ascii=False)``; a
  missing or ``null`` arguments field means ``{}``, and a string that holds a JSON object is decoded.
* Output that does not parse (malformed JSON, a missing or non-string name, arguments that are not an
  object, an unclosed tag, stray text inside the tool region, a region with no call) is returned by
  ``extract`` as plain content: ``tools_called=False`` and ``content`` the original text. Parsers never
  raise on model output.
* Output cut short by ``max_tokens`` (``truncated``) in the middle of the tool region keeps the calls
  completed before the cut and drops the incomplete rest: it is neither a call nor content.
* Streaming cannot take back what it has sent. A call is streamed when it is complete (its ``id`` and
  name, then its arguments), so a malformed or cut call is never streamed as a call; after a
  malformed one the rest of the output from that call on is streamed as content. Calls completed
  before it stay sent. So streaming and ``extract`` agree exactly (names, arguments, content) for
  output that parses and for output cut in its tool region.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

_ID_ALPHABET = string.ascii_letters + string.digits


def make_tool_call_id() -> str:
    """A fresh OpenAI-style id: ``call_`` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass
class FunctionCall:
    """The function a tool call names; ``arguments`` is a JSON object as a string, as OpenAI sends it."""

    name: str
    arguments: str


@dataclass
class ToolCall:
    """One complete tool call, as in a chat completion's ``message.tool_calls``."""

    id: str
    function: FunctionCall
    type: str = "function"


@dataclass
class ExtractedToolCalls:
    """What :meth:`ToolParser.extract` finds in a complete output.

    ``content`` is the text before the tool calls (``None`` when there is none) when
    ``tools_called``, else the whole original text.
    """

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


@dataclass
class DeltaToolCall:
    """One streamed piece of a tool call: first ``index``, ``id`` and ``name``, then ``arguments``
    fragments (with ``id`` and ``name`` ``None``) that concatenate to the call's arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass
class DeltaMessage:
    """What one :meth:`ToolParser.feed` or :meth:`ToolParser.finish` call yields: new content, if any,
    and tool-call pieces in order."""

    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


# What ``ToolParser._step`` reports about the tool region from ``self._pos`` on.
@dataclass
class More:
    """Nothing more can be decided without more text; ``name`` is the current call's name once known
    (it is not sent before the call is complete)."""

    name: str | None = None


@dataclass
class Skip:
    """A separator or marker up to ``end`` was consumed; step again."""

    end: int


@dataclass
class Call:
    """A complete, well-formed call that ends at ``end``."""

    name: str
    arguments: str
    end: int


@dataclass
class Done:
    """The tool region ended properly (only reported when the output is final)."""


@dataclass
class Bad:
    """The tool region is malformed."""


Step = More | Skip | Call | Done | Bad


class ToolParser(ABC):
    """Parses one response's tool calls; make one instance per streamed response.

    Subclasses implement :meth:`_locate` (where the tool region starts) and :meth:`_step` (the next
    call in it); this class turns them into ``extract``, ``feed`` and ``finish``.
    """

    name: ClassVar[str]

    def __init__(self, id_factory: Callable[[], str] | None = None) -> None:
        self._id_factory: Callable[[], str] = id_factory or make_tool_call_id
        self._text = ""
        # Content mode: the first character not yet sent. Tool mode: where ``_step`` goes on from.
        self._pos = 0
        self._mode: Literal["content", "tools", "raw", "done"] = "content"
        self._region_start: int | None = None
        self._raw_start = 0  # the start of what a malformed region would send as content
        self._calls: list[ToolCall] = []
        self._finished = False
        self._malformed = False
        self._cut = False  # the output ended (truncated) inside the tool region; its rest was dropped

    # -- the public API ---------------------------------------------------------------------------

    def extract(self, text: str, truncated: bool = False) -> ExtractedToolCalls:
        """The tool calls in a finished output, or the whole text as content when there are none or
        the output does not parse. ``truncated``: the output was cut short (``max_tokens``); a tool
        region it ends in keeps its complete calls and loses the rest. Leaves this instance's
        streaming state alone."""
        parser = self._fresh()
        parser.feed(text)
        parser.finish(truncated)
        if parser._malformed or not (parser._calls or parser._cut):
            return ExtractedToolCalls(tools_called=False, tool_calls=[], content=text)
        assert parser._region_start is not None
        return ExtractedToolCalls(
            tools_called=bool(parser._calls),
            tool_calls=list(parser._calls),
            content=text[: parser._region_start] or None,
        )

    def feed(self, delta_text: str) -> DeltaMessage:
        """Takes the next piece of generated text; returns what can be sent for it now."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._text += delta_text
        return self._run(final=False)

    def finish(self, truncated: bool = False) -> DeltaMessage:
        """Ends the output: sends held-back content, and the unparsed rest of an incomplete region as
        content, unless ``truncated`` (cut short by ``max_tokens``): then an incomplete region's rest
        is dropped."""
        if self._finished:
            return DeltaMessage()
        self._finished = True
        return self._run(final=True, truncated=truncated)

    def _fresh(self) -> ToolParser:
        """A new parser of the same format and ids, for :meth:`extract`."""
        return type(self)(id_factory=self._id_factory)

    # -- what a format implements -----------------------------------------------------------------

    @abstractmethod
    def _locate(self, text: str, start: int, final: bool) -> tuple[int, int | None]:
        """In content mode, with ``text[:start]`` sent: ``(safe, region)``, where ``text[:safe]`` may be
        sent as content and ``region`` is where the tool region starts (then ``safe == region``), or
        ``None``. When ``final`` nothing may be held back."""

    @abstractmethod
    def _step(self, final: bool) -> Step:
        """In tool mode: what ``self._text`` holds from ``self._pos`` on. ``More`` when ``final`` is
        taken as malformed."""

    # -- the engine ---------------------------------------------------------------------------------

    def _run(self, final: bool, truncated: bool = False) -> DeltaMessage:
        content: list[str] = []
        deltas: list[DeltaToolCall] = []
        text = self._text
        if self._mode == "content":
            safe, region = self._locate(text, self._pos, final)
            if safe > self._pos:
                content.append(text[self._pos : safe])
                self._pos = safe
            if region is not None:
                self._mode = "tools"
                self._region_start = self._raw_start = self._pos = region
        while self._mode == "tools":
            step = self._step(final)
            if isinstance(step, More) and final:
                if truncated:  # cut inside the region: the complete calls stay, the rest is dropped
                    self._cut = True
                    self._mode = "done"
                    self._pos = len(text)
                    break
                step = Bad()
            if isinstance(step, Skip):
                self._pos = step.end
            elif isinstance(step, Call):
                index = len(self._calls)
                call_id = self._id_factory()
                deltas.append(DeltaToolCall(index=index, id=call_id, name=step.name))
                deltas.append(DeltaToolCall(index=index, arguments=step.arguments))
                self._calls.append(ToolCall(id=call_id, function=FunctionCall(step.name, step.arguments)))
                self._pos = self._raw_start = step.end
            elif isinstance(step, More):
                break
            elif isinstance(step, Done) and self._calls:
                self._mode = "done"
            else:  # Bad, or a region that ended without a call
                self._malformed = True
                self._mode = "raw"
                self._pos = self._raw_start
        if self._mode == "raw" and self._pos < len(text):
            content.append(text[self._pos :])
            self._pos = len(text)
        return DeltaMessage(content="".join(content) or None, tool_calls=deltas)

    def _skip_ws(self, i: int) -> int:
        text = self._text
        while i < len(text) and text[i].isspace():
            i += 1
        return i


# -- helpers the formats share ----------------------------------------------------------------------


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def locate_marker(text: str, start: int, final: bool, marker: str) -> tuple[int, int | None]:
    """``ToolParser._locate`` for a region that starts at the first ``marker`` anywhere."""
    found = text.find(marker, start)
    if found >= 0:
        return found, found
    if final:
        return len(text), None
    return len(text) - partial_suffix(text[start:], marker), None


class JsonScanner:
    """Finds where a JSON object or array that starts at ``start`` ends, one chunk at a time: counts
    brackets outside strings. Whether the text in between is valid JSON is left to ``json.loads``."""

    def __init__(self, start: int) -> None:
        self.start = start
        self._i = start
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def advance(self, text: str) -> int | None:
        """The index just past the value's closing bracket, or ``None`` while it is still open."""
        i, depth, in_string, escaped = self._i, self._depth, self._in_string, self._escaped
        end = None
        while i < len(text):
            c = text[i]
            i += 1
            if in_string:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth <= 0:
                    end = i
                    break
        self._i, self._depth, self._in_string, self._escaped = i, depth, in_string, escaped
        return end


class CallObjectScanner:
    """Reads one call object (``{"name": ..., "arguments"|"parameters": {...}}``) that starts at
    ``start``, a chunk at a time: ``More`` (with the name once it is known) while it is open, then
    the ``Call``, or ``Bad`` when it is not a call."""

    def __init__(self, start: int) -> None:
        self._scanner = JsonScanner(start)
        self._name: str | None = None

    def step(self, text: str) -> More | Call | Bad:
        start = self._scanner.start
        end = self._scanner.advance(text)
        if end is None:
            if self._name is None:
                self._name = early_json_name(text, start)
            return More(self._name)
        parsed = call_from_json(text[start:end])
        return Bad() if parsed is None else Call(parsed[0], parsed[1], end)


def normalize_arguments(value: Any) -> str | None:
    """A call's arguments as OpenAI's JSON string, or ``None`` when they are not a JSON object.

    ``None`` (absent) means ``{}``; a string is decoded as JSON first."""
    if value is None:
        value = {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return None
    if not isinstance(value, dict):
        return None
    try:
        return json.dumps(value, ensure_ascii=False)
    except (ValueError, TypeError, RecursionError):
        return None


def call_from_json(text: str) -> tuple[str, str] | None:
    """``(name, arguments)`` from a call object ``{"name": ..., "arguments"|"parameters": {...}}``, or
    ``None`` when ``text`` is not one."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name or early_json_name(text, 0) not in (None, name):
        return None  # (the second test: a repeated "name" key, whose first value streaming may have sent)
    arguments = normalize_arguments(obj["arguments"] if "arguments" in obj else obj.get("parameters"))
    if arguments is None:
        return None
    return name, arguments


def early_json_name(text: str, start: int) -> str | None:
    """The call's name when the object at ``text[start:]`` opens with a complete ``"name"`` member,
    so it can be streamed before the call is complete."""
    match = _NAME_FIRST.match(text, start)
    if match is None:
        return None
    try:
        name = json.loads(match.group(1))
    except ValueError:
        return None
    return name if isinstance(name, str) and name else None


_NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
