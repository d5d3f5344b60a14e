"""Qwen3: the model opens its reasoning with ``<think>`` itself::

    <think>
    The user asks for ... so the answer is 4.
    </think>
    2 + 2 = 4.

An output without a leading ``<think>`` is content (thinking switched off), unless the prompt already
opened the reasoning (the templates of Qwen3's thinking-only models end with ``<think>``): then it is
reasoning up to ``</think>``.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning_parsers.base import Mode, ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    """``<think>…</think>`` at the start of the output (or after a prompt that opened it)."""

    name = "qwen3"

    def _untagged_mode(self) -> Mode:
        return "reasoning" if self.prompt_opens_reasoning else "content"
