"""The shared part of the reasoning parsers: the results and the streaming state machine.

A reasoning model writes its chain of thought between ``<think>`` and ``</think>`` before the answer.
A parser splits a generated text into that reasoning (``reasoning_content``) and the rest
(``content``), either all at once (:meth:`ReasoningParser.extract`) or while the text streams in
(:meth:`ReasoningParser.feed`, then :meth:`ReasoningParser.finish`). Both run the same code:
``extract`` feeds the whole text to a fresh parser, so for every way of cutting a text into pieces
the streamed deltas add up to exactly what ``extract`` returns.

The rules every parser follows:

* A leading ``start`` tag (after optional whitespace, which is dropped with it) is not part of the
  reasoning. While the output so far could still be such a tag (whitespace, ``"<thi"``), nothing is
  sent.
* Reasoning ends at the first ``end`` tag, which belongs to neither part; everything after it is
  content, sent as it arrives. While reasoning, a tail that may be the start of ``end`` (``"</th"``)
  is held back until the next piece decides it.
* What an output without a leading ``start`` tag is, each format says (:meth:`_untagged_mode`).
* Empty parts are ``None``: ``ExtractedReasoning(None, None)`` for an empty output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

# Where the parser is: before the output has shown whether it opens with ``start``; inside the
# reasoning; after it.
Mode = Literal["opening", "reasoning", "content"]


@dataclass
class ExtractedReasoning:
    """A complete output split: its reasoning and its content (``None`` when empty)."""

    reasoning: str | None
    content: str | None


@dataclass
class ReasoningDelta:
    """What one :meth:`ReasoningParser.feed` or :meth:`ReasoningParser.finish` call yields (``None``
    where it adds nothing)."""

    reasoning_content: str | None = None
    content: str | None = None


class ReasoningParser(ABC):
    """Splits one response's reasoning from its content; make one instance per streamed response."""

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"

    def __init__(self, prompt_opens_reasoning: bool = False) -> None:
        # The prompt ends with ``start`` (a template that makes the model think): the output begins
        # inside the reasoning.
        self.prompt_opens_reasoning = prompt_opens_reasoning
        self._text = ""
        self._pos = 0  # text before this has been sent (or dropped, for the tags)
        self._search = 0  # where to look for ``end`` next
        self._mode: Mode = "opening"
        self._ended = False
        self._finished = False

    @abstractmethod
    def _untagged_mode(self) -> Mode:
        """What an output that does not open with ``start`` is: ``reasoning`` (until ``end``) or
        ``content``."""

    @property
    def starts_in_reasoning(self) -> bool:
        """Whether an output is reasoning from its first token on unless it opens otherwise: then a
        structured-output constraint must wait for ``end``."""
        return self._untagged_mode() == "reasoning"

    # -- the API --------------------------------------------------------------------------------

    def extract(self, text: str) -> ExtractedReasoning:
        """Split a complete output (this instance's streaming state is not touched)."""
        parser = type(self)(self.prompt_opens_reasoning)
        parts = [parser.feed(text), parser.finish()]
        reasoning = "".join(p.reasoning_content or "" for p in parts)
        content = "".join(p.content or "" for p in parts)
        return ExtractedReasoning(reasoning or None, content or None)

    def feed(self, delta_text: str) -> ReasoningDelta:
        """Take the next piece of the output; returns what can be sent now."""
        if self._finished:
            raise RuntimeError(f"{type(self).__name__}.feed() after finish()")
        self._text += delta_text
        return self._advance(final=False)

    def finish(self) -> ReasoningDelta:
        """The output is complete: returns everything still held back."""
        if self._finished:
            raise RuntimeError(f"{type(self).__name__}.finish() called twice")
        self._finished = True
        return self._advance(final=True)

    @property
    def reasoning_ended(self) -> bool:
        """True once the ``end`` tag has been read: whatever follows is content."""
        return self._ended

    # -- the state machine ----------------------------------------------------------------------

    def _advance(self, final: bool) -> ReasoningDelta:
        text = self._text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._mode == "opening":
                rest = text[self._pos :]
                stripped = rest.lstrip()
                if stripped.startswith(self.start):
                    self._enter("reasoning", self._pos + len(rest) - len(stripped) + len(self.start))
                    continue
                if not final and self.start.startswith(stripped):
                    break  # still possibly the opening tag
                self._enter(self._untagged_mode(), self._pos)
                continue
            if self._mode == "reasoning":
                idx = text.find(self.end, self._search)
                if idx >= 0:
                    reasoning.append(text[self._pos : idx])
                    self._ended = True
                    self._enter("content", idx + len(self.end))
                    continue
                cut = len(text) if final else len(text) - _partial_suffix(text, self.end, self._pos)
                reasoning.append(text[self._pos : cut])
                self._pos = self._search = cut
                break
            content.append(text[self._pos :])
            self._pos = len(text)
            break
        return ReasoningDelta("".join(reasoning) or None, "".join(content) or None)

    def _enter(self, mode: Mode, pos: int) -> None:
        self._mode = mode
        self._pos = self._search = pos


def _partial_suffix(text: str, marker: str, start: int) -> int:
    """The length of the longest proper prefix of ``marker`` that ends ``text[start:]``."""
    for k in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
