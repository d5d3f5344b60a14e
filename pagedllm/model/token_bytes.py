"""A token's own bytes, as the logprob ``bytes`` fields of the OpenAI API carry them.

A token may hold part of a character (byte-level BPE splits "💡" into three tokens of 2, 1 and 1 bytes;
SentencePiece has ``<0xF0>`` byte-fallback tokens): decoding it alone gives U+FFFD, whose bytes are
not the token's. :class:`TokenBytes` reads the bytes from the vocabulary instead: byte-fallback
pieces by their value, byte-level pieces through the byte-to-character table of byte-level BPE, and
every other token (special and added tokens, SentencePiece words) as the UTF-8 of its decoded text.
The bytes of a sequence's tokens then add up to the UTF-8 of its text.
"""

from __future__ import annotations

import functools
import re
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE's character -> byte table (the inverse of its byte -> printable character map)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def _is_byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer's pieces are byte-level BPE characters (GPT-2, Llama 3, Qwen, SmolLM)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None) if backend is not None else None
    return decoder is not None and "ByteLevel" in repr(decoder)


class TokenBytes:
    """``token_bytes(token_id)``: the bytes of one token of ``tokenizer`` (cached per id)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.byte_decoder = _byte_level_decoder() if _is_byte_level(tokenizer) else None
        self.special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.special.update(int(i) for i in added)
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        raw = self._cache.get(token_id)
        if raw is None:
            raw = self._cache[token_id] = self._bytes(token_id)
        return raw

    def _bytes(self, token_id: int) -> bytes:
        if token_id not in self.special:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                match = _BYTE_PIECE.fullmatch(piece)
                if match:
                    return bytes([int(match.group(1), 16)])
                table = self.byte_decoder
                if table is not None and piece and all(c in table for c in piece):
                    return bytes(table[c] for c in piece)
        return str(self.tokenizer.decode([token_id])).encode("utf-8")


def display_token(raw: bytes) -> str | None:
    """The ``token`` string of a token whose bytes are not whole UTF-8 characters: the characters it
    has, and ``\\xNN`` for each other byte (as OpenAI shows such tokens); None for valid UTF-8."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="backslashreplace")
    return None
