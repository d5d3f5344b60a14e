"""Incremental detokenization: the deltas add up to the decoded output, token by token, on both
paths (the ``tokenizers`` streaming decoder and the window fallback), multi-byte characters come out
whole, and special tokens are skipped or kept as asked."""

from __future__ import annotations

import random
from typing import Any

import pytest

from helpers.model_factory import default_tokenizer
from pagedllm.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "数据库中的分页内存 🚀🎉 and  spaces\n\n\tcode: def f(x):\n    return x**2 ",
    "Ünïcödé façade — “quotes” ½ ≤ ≥ ∑ 𝔘𝔫𝔦 👩‍👩‍👧",
    " leading space, then punctuation . , ! and a final space ",
]


class WindowOnly:
    """The default tokenizer without its fast backend, so the window fallback is used."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


def token_cases() -> list[list[int]]:
    tok = default_tokenizer()
    rng = random.Random(0)
    cases = [list(tok.encode(text, add_special_tokens=False)) for text in TEXTS]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi 👋"}], tokenize=False)
    cases.append(list(tok.encode(chat, add_special_tokens=False)))  # special tokens inside
    cases.append([rng.randrange(len(tok)) for _ in range(300)])  # any id, partial characters included
    return cases


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_add_up_to_the_decoded_output(streaming: bool, skip_special_tokens: bool) -> None:
    tok = default_tokenizer()
    used = tok if streaming else WindowOnly(tok)
    for ids in token_cases():
        prompt, output = ids[:4], ids[4:]
        detok = IncrementalDetokenizer(used, prompt, skip_special_tokens)
        assert detok.streaming is streaming
        deltas = [detok.step(token_id) for token_id in output]
        # What the prompt context adds is not emitted; the output alone decodes to the same text
        # (these outputs start at a word boundary or with a special token).
        expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)[
            len(tok.decode(prompt, skip_special_tokens=skip_special_tokens)) :
        ]
        assert "".join(deltas) == expected
        assert not any(d.endswith("\ufffd") for d in deltas if d) or "\ufffd" in expected


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_tokens_in_one_call_equals_stepping(streaming: bool, skip_special_tokens: bool) -> None:
    """The deferred path: all of a sequence's tokens in one call give the summed deltas, also when the
    text ends in a partial character (the one call then holds everything back and steps instead)."""
    tok = default_tokenizer()
    used = tok if streaming else WindowOnly(tok)
    partial = tok.encode("日本", add_special_tokens=False)
    rng = random.Random(5)
    cases = token_cases() + [[rng.randrange(len(tok)) for _ in range(60)] for _ in range(40)]
    cases.append(list(tok.encode("Hello world", add_special_tokens=False)) + partial[:1])
    ends_partial = 0
    for ids in cases:
        prompt, output = ids[:4], ids[4:]
        stepped = IncrementalDetokenizer(used, prompt, skip_special_tokens)
        expected = "".join(stepped.step(t) for t in output)
        once = IncrementalDetokenizer(used, prompt, skip_special_tokens)
        assert once.decode_tokens(output) == expected
        full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        ends_partial += full.endswith("\ufffd")
        with pytest.raises(RuntimeError):
            once.decode_tokens(output)
    assert ends_partial > 0, "no case exercised a text ending in a partial character"
