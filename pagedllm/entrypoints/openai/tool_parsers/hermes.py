"""The Hermes format, used by Qwen2.5, Qwen3 and the Hermes models.

Each call is a JSON object in its own block::

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"zone": "CET"}}
    </tool_call>

Text before the first ``<tool_call>`` is content. From there on only blocks and whitespace between
and after them may follow; each block holds exactly one call object (``"arguments"`` or
``"parameters"``). An unclosed block, a block that is not a call object, or other text between the
blocks makes the output malformed (see :mod:`.base`).
"""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.entrypoints.openai.tool_parsers.base import (
    Bad,
    Call,
    Done,
    More,
    Skip,
    Step,
    ToolParser,
    call_from_json,
    early_json_name,
    locate_marker,
)

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks after optional content."""

    name = "hermes"

    def __init__(self, id_factory: Callable[[], str] | None = None) -> None:
        super().__init__(id_factory)
        self._body_start: int | None = None  # inside a block: where its JSON starts
        self._search = 0  # where to look for END next
        self._name: str | None = None

    def _locate(self, text: str, start: int, final: bool) -> tuple[int, int | None]:
        return locate_marker(text, start, final, START)

    def _step(self, final: bool) -> Step:
        text = self._text
        if self._body_start is None:
            i = self._skip_ws(self._pos)
            rest = text[i:]
            if not rest:
                return Done() if final else More()
            if rest.startswith(START):
                self._body_start = self._search = i + len(START)
                self._name = None
                return Skip(i + len(START))
            return More() if START.startswith(rest) else Bad()
        end = text.find(END, self._search)
        if end < 0:
            self._search = max(self._body_start, len(text) - len(END) + 1)
            if self._name is None:
                self._name = early_json_name(text, self._body_start)
            return More(self._name)
        parsed = call_from_json(text[self._body_start : end])
        self._body_start = None
        if parsed is None:
            return Bad()
        return Call(parsed[0], parsed[1], end + len(END))
