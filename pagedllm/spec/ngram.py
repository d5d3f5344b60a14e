"""Prompt-lookup (n-gram) proposals: draft the tokens that followed an earlier copy of the sequence's end.

For a sequence ``t[0..T-1]`` (prompt and output so far) an *occurrence* of length ``n`` ends at
``e <= T - 2`` when ``t[e-n+1..e] == t[T-n..T-1]``; ``e <= T - 2`` keeps at least one token after it,
and an occurrence may overlap the suffix it copies. The proposal comes from the longest ``n`` in
``[min_n, max_n]`` that has an occurrence, and from the *first* (leftmost) such occurrence, as vLLM's
proposer chooses: up to ``k`` of the tokens that follow it, fewer when the sequence ends first.

The search is ``O(T * max_n)`` vectorised numpy: one comparison of the whole sequence per suffix
offset, stopping as soon as no end position still matches.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _check_bounds(k: int, min_n: int, max_n: int) -> None:
    if min_n < 1 or min_n > max_n:
        raise ValueError(f"n-gram bounds must satisfy 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    if k < 0:
        raise ValueError(f"k must be non-negative, got {k}")


def match_lengths(tokens: np.ndarray, max_n: int) -> np.ndarray:
    """``out[e]`` for ``e`` in ``[0, T-2]``: the length (capped at ``max_n``) of the longest run ending
    at ``e`` that equals the sequence's suffix of the same length; 0 where ``t[e] != t[T-1]``."""
    num_ends = tokens.shape[0] - 1
    lengths = np.zeros(max(num_ends, 0), dtype=np.int64)
    if num_ends <= 0:
        return lengths
    alive = np.ones(num_ends, dtype=bool)
    for j in range(min(max_n, num_ends)):
        # Ends e >= j compare t[e - j] with the suffix's t[T-1-j]; shorter prefixes cannot reach back.
        alive[:j] = False
        alive[j:] &= tokens[: num_ends - j] == tokens[-1 - j]
        if not alive.any():
            break
        lengths += alive
    return lengths


def propose_ngram(token_ids: np.ndarray | Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` draft tokens for the sequence ``token_ids`` (see the module docstring); ``[]`` when
    no suffix of ``min_n`` to ``max_n`` tokens occurs earlier, or ``k == 0``.

    Every returned list is a contiguous slice of ``token_ids`` that starts right after an earlier
    occurrence of the sequence's last ``n >= min_n`` tokens. Callers cap ``k`` themselves where the
    context length would be exceeded.
    """
    _check_bounds(k, min_n, max_n)
    tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    if k == 0 or tokens.shape[0] <= min_n:
        return []
    lengths = match_lengths(tokens, max_n)
    longest = int(lengths.max())
    if longest < min_n:
        return []
    start = int(np.argmax(lengths == longest)) + 1  # the first end of a longest occurrence, plus one
    return [int(t) for t in tokens[start : start + k]]


def propose_ngram_batch(
    sequences: Sequence[np.ndarray | Sequence[int]], k: int, min_n: int, max_n: int
) -> list[list[int]]:
    """:func:`propose_ngram` for each sequence, in order (one list per sequence, possibly empty)."""
    _check_bounds(k, min_n, max_n)
    return [propose_ngram(sequence, k, min_n, max_n) for sequence in sequences]
