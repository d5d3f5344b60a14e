"""Qwen3: the model opens its reasoning with ``<think>`` itself::

    <think>
    The user asks for ... so the answer is 4.
    </think>

    2 + 2 = 4.

Without a leading ``<think>`` the output is reasoning only up to a ``</think>`` that follows (the
templates of Qwen3's thinking-only models put ``<think>`` in the prompt); an output with neither tag
is content (thinking switched off). Since only a later ``</think>`` tells those two apart, such an
output is held back while it streams until ``</think>`` appears or the output ends.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning_parsers.base import Mode, ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    """``<think>…</think>`` at the start of the output, or text before a ``</think>``."""

    name = "qwen3"

    def _untagged_mode(self) -> Mode:
        return "undecided"
