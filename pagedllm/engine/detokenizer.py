"""Incremental detokenization: turn each new token into the text it adds, in O(1) per token."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens decoded as context so the first output token gets the right leading space.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Emits text deltas for a growing list of tokens; the deltas add up to the decoded output.

    A delta is emitted only when it does not end in a partial UTF-8 character, so multi-token
    characters come out whole. With a fast tokenizer (that does not clean up spaces) the work is one
    call into the ``tokenizers`` library's streaming decoder per token (its state: a short window of
    ids and their text).
    Otherwise a short window ``tokens[prefix_offset:]`` is decoded and compared with the text of
    ``tokens[prefix_offset:read_offset]``; a delta is emitted when the text grew and does not end in
    U+FFFD. Both are primed with the last prompt tokens, whose text is never emitted.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._context = context
        self._stepped = False
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream: Any = None
        # The streaming decoder does not apply transformers' clean-up of spaces before punctuation.
        cleanup = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        if isinstance(backend, Tokenizer) and not cleanup:
            self._backend = backend
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            for token_id in context:
                self._stream.step(backend, token_id)
            return
        self.tokens: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    @property
    def streaming(self) -> bool:
        """Whether the ``tokenizers`` streaming decoder does the work."""
        return self._stream is not None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def decode_tokens(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` fed to a detokenizer that has not been stepped yet: what
        :meth:`step` would emit for them one by one, summed, in one call into the streaming decoder.

        That call holds everything back when the whole text ends in a partial character; then the
        tokens are stepped one by one after all (on a decoder primed afresh), which emits the text
        up to the last complete character, as stepping would have.
        """
        if self._stepped:
            raise RuntimeError("decode_tokens needs a detokenizer that has not been stepped yet.")
        self._stepped = True
        if self._stream is not None and token_ids:
            text = self._stream.step(self._backend, token_ids)
            if text is not None:
                return str(text)
            fresh = IncrementalDetokenizer(self.tokenizer, self._context, self.skip_special_tokens)
            self._stream = fresh._stream
        return "".join(self.step(t) for t in token_ids)

    def step(self, token_id: int) -> str:
        self._stepped = True
        if self._stream is not None:
            return self._stream.step(self._backend, token_id) or ""
        self.tokens.append(token_id)
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            return delta
        return ""
