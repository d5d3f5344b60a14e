"""Splitting one chat choice's generated text into reasoning, content and tool calls.

The text passes through up to two parsers in order: the server's reasoning parser (``<think>`` ...
``</think>`` becomes ``reasoning_content``), then the request's tool parser, which reads only what
follows the reasoning. :meth:`ChoiceOutput.complete` splits a finished output;
:meth:`ChoiceOutput.feed` and :meth:`ChoiceOutput.finish` split it while it streams, and for output
that parses they add up to exactly what ``complete`` returns (both parsers keep that promise).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.protocol import (
    DeltaFunctionCall,
    DeltaToolCallModel,
    ResponseFunctionCall,
    ResponseToolCall,
)
from pagedllm.entrypoints.openai.tool_parsers import ToolParser


@dataclass
class CompleteChoice:
    """A finished choice's message fields; ``tool_calls`` empty when the output holds none."""

    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] = field(default_factory=list)


@dataclass
class ChoiceDelta:
    """What one streamed piece of text adds to a choice's message."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[DeltaToolCallModel] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning_content or self.tool_calls)


class ChoiceOutput:
    """Splits one choice's output. ``parallel=False`` keeps only its first tool call.

    ``reasoning_factory`` makes the server's reasoning parser (any object with ``extract``, ``feed``
    and ``finish`` as in :mod:`.reasoning_parsers`); ``tool_parser`` is a fresh tool parser.
    """

    def __init__(
        self,
        tool_parser: ToolParser | None,
        reasoning_factory: Callable[[], Any] | None = None,
        *,
        parallel: bool = True,
    ) -> None:
        self._tools = tool_parser
        self._reasoning = reasoning_factory() if reasoning_factory is not None else None
        self._reasoning_factory = reasoning_factory
        self._parallel = parallel
        self.called_tools = False

    # -- a finished output ----------------------------------------------------------------------

    def complete(self, text: str, truncated: bool = False) -> CompleteChoice:
        """The message of a finished output; ``truncated``: it was cut short by ``max_tokens`` (a tool
        call it cuts is dropped, see :mod:`.tool_parsers.base`)."""
        reasoning: str | None = None
        content: str | None = text
        if self._reasoning_factory is not None:
            split = self._reasoning_factory().extract(text)
            reasoning, content = split.reasoning, split.content
        if self._tools is None or not content:
            return CompleteChoice(content=content, reasoning_content=reasoning)
        extracted = self._tools.extract(content, truncated)
        if not extracted.tools_called:
            return CompleteChoice(content=extracted.content, reasoning_content=reasoning)
        calls = extracted.tool_calls if self._parallel else extracted.tool_calls[:1]
        self.called_tools = True
        return CompleteChoice(
            content=extracted.content,
            reasoning_content=reasoning,
            tool_calls=[
                ResponseToolCall(
                    id=c.id,
                    function=ResponseFunctionCall(name=c.function.name, arguments=c.function.arguments),
                )
                for c in calls
            ],
        )

    # -- a streamed output ----------------------------------------------------------------------

    def feed(self, text: str) -> ChoiceDelta:
        if self._reasoning is None:
            return self._feed_content(text, final=False)
        split = self._reasoning.feed(text)
        delta = self._feed_content(split.content or "", final=False)
        delta.reasoning_content = split.reasoning_content or ""
        return delta

    def finish(self, truncated: bool = False) -> ChoiceDelta:
        if self._reasoning is None:
            return self._feed_content("", final=True, truncated=truncated)
        split = self._reasoning.finish()
        delta = self._feed_content(split.content or "", final=True, truncated=truncated)
        delta.reasoning_content = split.reasoning_content or ""
        return delta

    def _feed_content(self, text: str, *, final: bool, truncated: bool = False) -> ChoiceDelta:
        if self._tools is None:
            return ChoiceDelta(content=text)
        parts = [self._tools.feed(text)] if text else []
        if final:
            parts.append(self._tools.finish(truncated))
        delta = ChoiceDelta(content="".join(p.content or "" for p in parts))
        for part in parts:
            for piece in part.tool_calls:
                if piece.index > 0 and not self._parallel:
                    continue
                self.called_tools = True
                if piece.name is not None:
                    delta.tool_calls.append(
                        DeltaToolCallModel(
                            index=piece.index,
                            id=piece.id,
                            type="function",
                            function=DeltaFunctionCall(name=piece.name),
                        )
                    )
                if piece.arguments is not None:
                    delta.tool_calls.append(
                        DeltaToolCallModel(
                            index=piece.index, function=DeltaFunctionCall(arguments=piece.arguments)
                        )
                    )
        return delta
