"""DeepSeek-R1 (and its distilled models): the chat template ends the prompt with ``<think>``, so the
output is reasoning from its first character until ``</think>``::

    The user asks for ... so the answer is 4.
    </think>

    2 + 2 = 4.

A leading ``<think>`` in the output (older templates leave it to the model) is dropped. An output
without ``</think>`` is reasoning only (content ``None``): the model stopped while thinking.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning_parsers.base import Mode, ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    """Reasoning from the start of the output until ``</think>``."""

    name = "deepseek_r1"

    def _untagged_mode(self) -> Mode:
        return "reasoning"
