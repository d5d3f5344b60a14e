"""Reasoning parsers: split a reasoning model's ``<think>…</think>`` from its answer, for a complete
output (:meth:`ReasoningParser.extract`) and incrementally while it streams
(:meth:`ReasoningParser.feed`, :meth:`ReasoningParser.finish`; one parser instance per response). The
rules shared by every format are in :mod:`.base`, each format's own in its module.

    parser_cls = get_reasoning_parser("deepseek_r1")
    result = parser_cls().extract(text)          # ExtractedReasoning(reasoning, content)
    streaming = parser_cls()
    for piece in pieces:
        delta = streaming.feed(piece)            # ReasoningDelta(reasoning_content, content)
    delta = streaming.finish()
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning_parsers.base import (
    ExtractedReasoning,
    ReasoningDelta,
    ReasoningParser,
)
from pagedllm.entrypoints.openai.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from pagedllm.entrypoints.openai.reasoning_parsers.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}; known: {known}") from None


__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "ExtractedReasoning",
    "Qwen3ReasoningParser",
    "ReasoningDelta",
    "ReasoningParser",
    "get_reasoning_parser",
]
