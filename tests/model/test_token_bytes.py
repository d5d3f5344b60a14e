"""A token's own bytes (the logprob ``bytes`` field): tokens that hold part of a character have their
real bytes, so a sequence's token bytes add up to its text's UTF-8, for a byte-level BPE vocabulary
(the default model's) and a SentencePiece one with byte-fallback pieces (Gemma 3's)."""

from __future__ import annotations

import pytest

from pagedllm.model import packaged
from pagedllm.model.loader import default_model_path
from pagedllm.model.token_bytes import TokenBytes, display_token
from pagedllm.model.tokenizer import load_tokenizer

TEXTS = ["💡 idea", "naïve café, 東京", "tab\tand\nnewline", "emoji 🎉🎉 and ✓", "plain words"]


def _check_vocabulary(path: str) -> int:
    tokenizer = load_tokenizer(path)
    token_bytes = TokenBytes(tokenizer)
    partial = 0
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        pieces = [token_bytes(i) for i in ids]
        assert b"".join(pieces) == text.encode("utf-8"), (text, ids, pieces)
        partial += sum(display_token(p) is not None for p in pieces)
    return partial


def test_byte_level_tokens_add_up_to_the_text() -> None:
    # The emoji and CJK characters are split across tokens: some tokens are not whole characters.
    assert _check_vocabulary(default_model_path()) > 0


def test_byte_fallback_tokens_add_up_to_the_text() -> None:
    try:
        path = packaged.packaged_gguf_file(packaged.GEMMA3_270M_NAME)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    assert path
    _check_vocabulary(path)


def test_partial_tokens_are_shown_with_escapes() -> None:
    assert display_token(b"\xf0\x9f") == "\\xf0\\x9f"
    assert display_token(b" a\xe2") == " a\\xe2"
    assert display_token("é".encode()) is None
