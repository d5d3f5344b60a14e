"""Assertions comparing greedy generations with the HF reference by vLLM's rule
(see ``pagedllm_bench.hf_reference``)."""

from __future__ import annotations

from typing import Any

from pagedllm_bench.hf_reference import greedy_compare, hf_greedy

__all__ = ["assert_greedy_close", "hf_greedy"]


def assert_greedy_close(
    a_tokens: list[int],
    a_top: list[dict[int, Any]] | None,
    b_tokens: list[int],
    b_top: list[dict[int, Any]] | None,
    label: str = "",
) -> bool:
    """Assert equality up to a near-tie flip; returns True when the sequences are identical."""
    assert a_top is not None and b_top is not None, "run with logprobs to compare by the top-k rule"
    status, i = greedy_compare(a_tokens, a_top, b_tokens, b_top)
    assert status != "mismatch", f"{label}: tokens differ at {i} beyond a near-tie:\n{a_tokens}\n{b_tokens}"
    if status == "near_tie":
        return False
    assert len(a_tokens) == len(b_tokens), f"{label}: lengths differ: {a_tokens} vs {b_tokens}"
    return True
