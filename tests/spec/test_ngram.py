"""Prompt-lookup proposals: hand-made cases and a brute-force reference."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.spec import propose_ngram, propose_ngram_batch
from pagedllm.spec.ngram import match_lengths


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, literally: the longest n first, then its leftmost earlier occurrence."""
    total = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[total - n :] if n <= total else None
        for start in range(0, total - n):  # the occurrence ends at start + n - 1 <= total - 2
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize(
    ("tokens", "k", "min_n", "max_n", "expected"),
    [
        # The example of vLLM's proposer: [4, 2, 3] has no earlier copy, [2, 3] does.
        ([1, 2, 3, 4, 2, 3], 4, 2, 3, [4, 2, 3]),
        # k truncates the tokens that follow.
        ([1, 2, 3, 4, 2, 3], 2, 2, 3, [4, 2]),
        # The longest n wins over an earlier, shorter match: [7, 8, 9] at 3..5, [8, 9] already at 0..1.
        ([8, 9, 5, 7, 8, 9, 1, 7, 8, 9], 3, 1, 3, [1, 7, 8]),
        # With max_n = 2 the same sequence takes the first [8, 9].
        ([8, 9, 5, 7, 8, 9, 1, 7, 8, 9], 3, 1, 2, [5, 7, 8]),
        # Of several occurrences of the longest n, the first one.
        ([5, 6, 1, 5, 6, 2, 5, 6], 1, 2, 2, [1]),
        # Overlapping occurrence: in a run of one token the suffix [3, 3] occurs at 0..1, overlapping it.
        ([3, 3, 3, 3], 5, 2, 2, [3, 3]),
        ([3, 3, 3], 5, 2, 3, [3]),
        # The proposal stops where the sequence ends.
        ([1, 2, 9, 1, 2], 5, 2, 2, [9, 1, 2]),
        # No earlier occurrence of any suffix of length min_n..max_n.
        ([1, 2, 3, 4, 5], 3, 1, 3, []),
        # Only a 1-gram matches, but min_n is 2.
        ([1, 2, 3, 1, 4, 3], 3, 2, 3, []),
        ([1, 2, 3, 1, 4, 3], 3, 1, 3, [1, 4, 3]),
        # The suffix [3, 4] (max_n = 2) occurs first inside the longer copy [1, 2, 3, 4].
        ([1, 2, 3, 4, 0, 2, 3, 4, 1, 2, 3, 4], 2, 1, 2, [0, 2]),
        # With max_n = 4 only the copy of [1, 2, 3, 4] at 5..8 matches in full; max_n = 3 takes [2, 3, 4] at 1..3.
        ([5, 2, 3, 4, 0, 1, 2, 3, 4, 1, 2, 3, 4], 2, 1, 4, [1, 2]),
        ([5, 2, 3, 4, 0, 1, 2, 3, 4, 1, 2, 3, 4], 2, 1, 3, [0, 1]),
        # Too short to hold an earlier occurrence of min_n tokens.
        ([4, 4], 3, 2, 3, []),
        ([4], 3, 1, 1, []),
        ([], 3, 1, 1, []),
        # k = 0 proposes nothing.
        ([1, 2, 1, 2], 0, 1, 2, []),
    ],
)
def test_hand_made_proposals(tokens: list[int], k: int, min_n: int, max_n: int, expected: list[int]) -> None:
    assert propose_ngram(tokens, k, min_n, max_n) == expected
    assert propose_ngram(np.array(tokens, dtype=np.int32), k, min_n, max_n) == expected
    assert reference(tokens, k, min_n, max_n) == expected


def test_match_lengths() -> None:
    # Suffix [.., 2, 1, 2]: the run [1, 2] ends at 1, the run [2] at 3.
    assert match_lengths(np.array([1, 2, 3, 2, 1, 2]), 3).tolist() == [0, 2, 0, 1, 0]
    assert match_lengths(np.array([2, 1, 2, 3, 2, 1, 2]), 3).tolist() == [1, 0, 3, 0, 1, 0]


def test_batch_is_one_call_per_sequence() -> None:
    sequences: list[np.ndarray | list[int]] = [[1, 2, 3, 4, 2, 3], np.array([9, 9]), [], [5, 6, 7, 5, 6]]
    assert propose_ngram_batch(sequences, 3, 2, 3) == [[4, 2, 3], [], [], [7, 5, 6]]


@pytest.mark.parametrize(("k", "min_n", "max_n"), [(3, 0, 2), (3, 3, 2), (-1, 1, 2)])
def test_bad_bounds(k: int, min_n: int, max_n: int) -> None:
    with pytest.raises(ValueError):
        propose_ngram([1, 2, 1, 2], k, min_n, max_n)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    k=st.integers(0, 6),
    bounds=st.tuples(st.integers(1, 5), st.integers(0, 4)).map(lambda b: (b[0], b[0] + b[1])),
)
def test_matches_the_reference(tokens: list[int], k: int, bounds: tuple[int, int]) -> None:
    """A 4-token alphabet makes repeats (and overlapping ones) common."""
    min_n, max_n = bounds
    assert propose_ngram(tokens, k, min_n, max_n) == reference(tokens, k, min_n, max_n)


def test_long_sequences_are_fast() -> None:
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 50, size=4000) for _ in range(64)]
    propose_ngram_batch(sequences[:2], 5, 2, 5)  # warm-up
    start = time.perf_counter()
    proposals = propose_ngram_batch(sequences, 5, 2, 5)
    elapsed = time.perf_counter() - start
    for sequence, proposal in zip(sequences[:4], proposals[:4], strict=True):
        assert proposal == reference(sequence.tolist(), 5, 2, 5)
    # 64 requests of 4000 tokens: a few milliseconds; a quadratic search would take seconds.
    assert elapsed < 1.0, f"{elapsed:.3f}s for 64 sequences of 4000 tokens"
