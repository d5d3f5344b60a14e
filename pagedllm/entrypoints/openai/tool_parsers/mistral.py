"""The Mistral format.

Content, then ``[TOOL_CALLS]`` and a JSON list of call objects (the v3 tokenizers)::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", "arguments": {}}]

or, with the v11+ tokenizers, a name, ``[ARGS]`` and the arguments object, ``[TOOL_CALLS]`` before
each call::

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f[ARGS]{}

Text before the first ``[TOOL_CALLS]`` is content. A name in the second form consists of letters,
digits, ``_``, ``-`` and ``.``. Anything but whitespace after the list, or between the calls of the
second form, makes the output malformed (see :mod:`.base`). Ids are the shared ``call_...`` form; a
server that must feed them back to a Mistral template with 9-character ids should map them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Literal

from pagedllm.entrypoints.openai.tool_parsers.base import (
    Bad,
    Call,
    Done,
    JsonScanner,
    More,
    Skip,
    Step,
    ToolParser,
    call_from_json,
    early_json_name,
    locate_marker,
    normalize_arguments,
    partial_suffix,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[\w\-.]+")

State = Literal[
    "marker", "kind", "item", "item_in", "item_after", "closed", "name", "args", "args_in", "args_after"
]


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS][{...}, ...]`` or ``[TOOL_CALLS]name[ARGS]{...}`` after optional content."""

    name = "mistral"

    def __init__(self, id_factory: Callable[[], str] | None = None) -> None:
        super().__init__(id_factory)
        self._state: State = "marker"
        self._scanner: JsonScanner | None = None
        self._name: str | None = None
        self._name_start = 0

    def _locate(self, text: str, start: int, final: bool) -> tuple[int, int | None]:
        return locate_marker(text, start, final, TOOL_CALLS)

    def _step(self, final: bool) -> Step:
        text = self._text
        state = self._state
        if state in ("item_in", "args_in"):
            return self._object_end()
        if state == "name":
            return self._name_end()
        i = self._skip_ws(self._pos)
        rest = text[i:]
        if state == "marker":  # the region starts at the marker
            self._state = "kind"
            return Skip(i + len(TOOL_CALLS))
        if not rest:
            if final and state in ("closed", "args_after"):
                return Done()
            return More(self._name if state == "args" else None)
        if state == "kind":
            if rest[0] == "[":
                self._state = "item"
                return Skip(i + 1)
            self._state = "name"
            self._name_start = i
            return Skip(i)
        if state == "item":
            if rest[0] != "{":
                return Bad()
            return self._open_object(i, "item_in")
        if state == "item_after":
            if rest[0] not in ",]":
                return Bad()
            self._state = "item" if rest[0] == "," else "closed"
            return Skip(i + 1)
        if state == "args":
            if rest[0] != "{":
                return Bad()
            return self._open_object(i, "args_in")
        if state == "args_after":
            if rest.startswith(TOOL_CALLS):
                self._state = "kind"
                return Skip(i + len(TOOL_CALLS))
            return More() if TOOL_CALLS.startswith(rest) else Bad()
        return Bad()  # "closed": only whitespace may follow the list

    def _open_object(self, i: int, state: State) -> Step:
        self._state = state
        self._scanner = JsonScanner(i)
        if state == "item_in":
            self._name = None
        return Skip(i)

    def _object_end(self) -> Step:
        text = self._text
        assert self._scanner is not None
        end = self._scanner.advance(text)
        if end is None:
            if self._state == "item_in" and self._name is None:
                self._name = early_json_name(text, self._scanner.start)
            return More(self._name)
        body = text[self._scanner.start : end]
        if self._state == "item_in":
            self._state = "item_after"
            parsed = call_from_json(body)
        else:
            self._state = "args_after"
            arguments = normalize_arguments(body)
            parsed = None if arguments is None or self._name is None else (self._name, arguments)
        return Bad() if parsed is None else Call(parsed[0], parsed[1], end)

    def _name_end(self) -> Step:
        text = self._text
        end = text.find(ARGS, self._name_start)
        if end < 0:
            rest = text[self._name_start :]
            rest = rest[: len(rest) - partial_suffix(rest, ARGS)]
            return More() if _NAME.fullmatch(rest) or not rest else Bad()
        name = text[self._name_start : end]
        if not _NAME.fullmatch(name):
            return Bad()
        self._name = name
        self._state = "args"
        return Skip(end + len(ARGS))
