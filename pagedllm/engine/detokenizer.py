"""Incremental detokenization: turn each new token into the text it adds, in O(1) per token."""

from __future__ import annotations

from typing import Any

# Prompt tokens decoded as context so the first output token gets the right leading space.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Emits text deltas for a growing list of tokens.

    Decodes a short window ``tokens[prefix_offset:]`` and compares it with the text of
    ``tokens[prefix_offset:read_offset]``; a delta is emitted only when it does not end in a
    partial UTF-8 character (U+FFFD), so multi-token characters come out whole.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: int) -> str:
        self.tokens.append(token_id)
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            return delta
        return ""
