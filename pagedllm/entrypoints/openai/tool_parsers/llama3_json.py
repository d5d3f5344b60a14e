"""The JSON format of Llama 3.1 and 3.2.

The whole output is one or more call objects separated by ``;``, optionally after ``<|python_tag|>``::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

The arguments may be under ``"parameters"`` (what the Llama chat template asks for) or
``"arguments"``. Only output that starts (after whitespace) with ``{`` or ``<|python_tag|>`` is taken
for tool calls; anything else is content. Such output is held back until it is decided, so a plain
JSON answer that is not a call (no ``"name"``) arrives as content when its object closes. Text other
than whitespace and ``;`` between or after the objects makes the output malformed (see :mod:`.base`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pagedllm.entrypoints.openai.tool_parsers.base import (
    Bad,
    CallObjectScanner,
    Done,
    More,
    Skip,
    Step,
    ToolParser,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """``{"name": ..., "parameters": {...}}`` objects separated by ``;``, the whole output."""

    name = "llama3_json"

    def __init__(self, id_factory: Callable[[], str] | None = None) -> None:
        super().__init__(id_factory)
        self._decided = False
        self._state: Literal["start", "object", "inside", "after"] = "start"
        self._call: CallObjectScanner | None = None

    def _locate(self, text: str, start: int, final: bool) -> tuple[int, int | None]:
        if self._decided:
            return len(text), None
        head = text.lstrip()
        if head.startswith(("{", PYTHON_TAG)):
            return 0, 0
        if not final and PYTHON_TAG.startswith(head):
            return 0, None  # only whitespace or part of the tag so far
        self._decided = True
        return len(text), None

    def _step(self, final: bool) -> Step:
        text = self._text
        if self._state == "inside":
            assert self._call is not None
            step = self._call.step(text)
            if not isinstance(step, More):
                self._state = "after"
            return step
        i = self._skip_ws(self._pos)
        if self._state == "start":
            self._state = "object"
            return Skip(i + len(PYTHON_TAG)) if text.startswith(PYTHON_TAG, i) else Skip(i)
        if i == len(text):
            return Done() if final else More()
        if self._state == "after":
            if text[i] != ";":
                return Bad()
            self._state = "object"
            return Skip(i + 1)
        if text[i] != "{":
            return Bad()
        self._state = "inside"
        self._call = CallObjectScanner(i)
        return Skip(i)
