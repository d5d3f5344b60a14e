"""Tool-call parsers: turn a model's generated text into OpenAI ``tool_calls``, for a complete output
(:meth:`ToolParser.extract`) and incrementally while it streams (:meth:`ToolParser.feed`,
:meth:`ToolParser.finish`; one parser instance per response). The rules shared by every format are in
:mod:`.base`, each format's own in its module.

    parser_cls = get_tool_parser("hermes")
    result = parser_cls().extract(text)          # ExtractedToolCalls
    streaming = parser_cls()
    for piece in pieces:
        delta = streaming.feed(piece)            # DeltaMessage
    delta = streaming.finish()
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import (
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    FunctionCall,
    ToolCall,
    ToolParser,
    make_tool_call_id,
)
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from pagedllm.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool parser {name!r}; known: {known}") from None


__all__ = [
    "TOOL_PARSERS",
    "DeltaMessage",
    "DeltaToolCall",
    "ExtractedToolCalls",
    "FunctionCall",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "PythonicToolParser",
    "ToolCall",
    "ToolParser",
    "get_tool_parser",
    "make_tool_call_id",
]
