"""The perplexity benchmark's shipped text and its windowing and scoring arithmetic (no llama.cpp)."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from pagedllm.model.loader import resolve_model_path
from pagedllm.model.tokenizer import load_tokenizer
from pagedllm.outputs import Logprob
from pagedllm_bench.perplexity import (
    DEFAULT_TEXT,
    PerplexityResult,
    log_softmax,
    make_windows,
    nll_from_logits,
    nll_from_prompt_logprobs,
    tokenizer_bos,
)

TEXT_SHA256 = "e398fe77f26f1ba6ea7ccc6e6f0b0c91c6de08ec7f1e5efa6be60dd39ccce4e6"


def test_shipped_text_is_there_and_long_enough() -> None:
    assert DEFAULT_TEXT.is_file()
    assert (DEFAULT_TEXT.parent / "README.md").is_file()
    data = DEFAULT_TEXT.read_bytes()
    # The README names the file's origin by this hash.
    assert hashlib.sha256(data).hexdigest() == TEXT_SHA256
    text = data.decode("ascii")
    assert text.startswith("The Constitution of the United States of America")
    tokenizer = load_tokenizer(resolve_model_path(None)[1])
    n = len(tokenizer.encode(text, add_special_tokens=False))
    assert n >= 4000, n


def test_default_tokenizer_adds_no_bos() -> None:
    # SmolLM2's GGUF says tokenizer.ggml.add_bos_token = false: windows start on text tokens.
    tokenizer = load_tokenizer(resolve_model_path(None)[1])
    assert tokenizer_bos(tokenizer) is None


class _Tokenizer:
    """Prepends ``bos`` to encodings with special tokens when ``adds`` is set."""

    def __init__(self, bos: int | None, adds: bool) -> None:
        self.bos_token_id = bos
        self.adds = adds

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [ord(c) for c in text]
        return [self.bos_token_id, *ids] if add_special_tokens and self.adds else ids


def test_tokenizer_bos() -> None:
    assert tokenizer_bos(_Tokenizer(7, True)) == 7
    assert tokenizer_bos(_Tokenizer(7, False)) is None
    assert tokenizer_bos(_Tokenizer(None, False)) is None


def test_windows_without_bos() -> None:
    tokens = list(range(10, 21))  # 11 tokens
    assert make_windows(tokens, 4, None) == [[10, 11, 12, 13], [14, 15, 16, 17], [18, 19, 20]]
    # A last window of a single token has nothing to score and is dropped.
    assert make_windows(tokens[:9], 4, None) == [[10, 11, 12, 13], [14, 15, 16, 17]]


def test_windows_with_bos_score_every_text_token_once() -> None:
    tokens = list(range(10, 21))
    windows = make_windows(tokens, 4, 1)
    assert windows == [[1, 10, 11, 12], [1, 13, 14, 15], [1, 16, 17, 18], [1, 19, 20]]
    assert [t for w in windows for t in w[1:]] == tokens
    assert all(len(w) <= 4 for w in windows)


def test_windows_refuse_a_context_with_nothing_to_score() -> None:
    with pytest.raises(ValueError, match="context"):
        make_windows([1, 2, 3], 1, None)
    with pytest.raises(ValueError, match="context"):
        make_windows([1, 2, 3], 1, 0)


def test_log_softmax_against_hand_computation() -> None:
    # exp(0) : exp(ln 3) = 1 : 3, so the probabilities are 1/4 and 3/4.
    row = np.array([[0.0, math.log(3.0)]], dtype=np.float32)
    out = log_softmax(row)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out[0], [math.log(0.25), math.log(0.75)], rtol=0, atol=1e-7)
    # Shifting a row changes nothing, and huge logits do not overflow.
    big = np.array([[1000.0, 1000.0 + math.log(3.0), -1000.0]])
    np.testing.assert_allclose(log_softmax(big)[0, :2], [math.log(0.25), math.log(0.75)], rtol=0, atol=1e-12)
    assert log_softmax(big)[0, 2] < -1999


def test_nll_from_logits_uses_row_i_for_token_i_plus_1() -> None:
    # Vocabulary of 3. Row 0 gives probabilities (1/6, 2/6, 3/6), row 1 (1/2, 1/4, 1/4); row 2 is unused.
    logits = np.log(np.array([[1.0, 2.0, 3.0], [2.0, 1.0, 1.0], [9.0, 1.0, 1.0]]))
    window = [0, 2, 1]  # predicts 2 from row 0 and 1 from row 1
    expected = -(math.log(3 / 6) + math.log(1 / 4))
    assert nll_from_logits(logits, window) == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ValueError):
        nll_from_logits(logits[:2], window)


def test_nll_from_prompt_logprobs_matches_the_logits_path() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 11))
    window = [int(t) for t in rng.integers(0, 11, size=6)]
    lp = log_softmax(logits)
    # As the engine reports them: entry i holds prompt token i's logprob (plus top-k others); entry 0 None.
    prompt_logprobs: list[dict[int, Logprob] | None] = [None]
    for i in range(1, 6):
        entry = {window[i]: Logprob(float(lp[i - 1, window[i]]), 1)}
        other = (window[i] + 1) % 11
        entry.setdefault(other, Logprob(float(lp[i - 1, other]), 2))
        prompt_logprobs.append(entry)
    assert nll_from_prompt_logprobs(prompt_logprobs, window) == pytest.approx(
        nll_from_logits(logits, window), abs=1e-9
    )
    broken = list(prompt_logprobs)
    broken[3] = {(window[3] + 1) % 11: Logprob(-1.0)}
    with pytest.raises(ValueError, match="position 3"):
        nll_from_prompt_logprobs(broken, window)
    with pytest.raises(ValueError):
        nll_from_prompt_logprobs(prompt_logprobs[:-1], window)


def test_perplexity_is_exp_of_mean_nll() -> None:
    # Two scored tokens of probability 1/2 and 1/8: mean NLL ln 4, perplexity 4.
    nll = -(math.log(1 / 2) + math.log(1 / 8))
    result = PerplexityResult("x", nll, 2, 1, 0.5)
    assert result.perplexity == pytest.approx(4.0)
    d = result.as_dict()
    assert d["mean_nll"] == pytest.approx(math.log(4))
    assert d["scored_tokens_per_s"] == pytest.approx(4.0)
