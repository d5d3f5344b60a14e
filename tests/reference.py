"""Comparing greedy generations by vLLM's rule: equal tokens, or at the first difference each
side's token is among the other side's top logprobs (a near-tie flipped), after which the two
sequences are free to diverge."""

from __future__ import annotations

from typing import Any

import torch


def hf_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int, top_k: int = 5) -> tuple[
    list[int], list[dict[int, float]]
]:
    """HF greedy generation with the top-k logprobs of the raw logits at each step."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=model.generation_config.eos_token_id,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    tops = []
    for step_logits in out.logits:
        lp = torch.log_softmax(step_logits[0].float(), dim=-1)
        vals, idx = lp.topk(top_k)
        tops.append({int(i): float(v) for i, v in zip(idx, vals, strict=True)})
    return tokens, tops


def top_of(logprobs: list[dict[int, Any]] | None, i: int) -> set[int]:
    assert logprobs is not None, "run with logprobs to compare by the top-k rule"
    return set(logprobs[i].keys())


def assert_greedy_close(
    a_tokens: list[int],
    a_top: list[dict[int, Any]] | None,
    b_tokens: list[int],
    b_top: list[dict[int, Any]] | None,
    label: str = "",
) -> bool:
    """Assert equality up to a near-tie flip; returns True when the sequences are identical."""
    n = min(len(a_tokens), len(b_tokens))
    for i in range(n):
        if a_tokens[i] != b_tokens[i]:
            assert a_tokens[i] in top_of(b_top, i) and b_tokens[i] in top_of(a_top, i), (
                f"{label}: tokens differ at {i} ({a_tokens[i]} vs {b_tokens[i]}) beyond a near-tie:\n"
                f"{a_tokens}\n{b_tokens}"
            )
            return False
    assert len(a_tokens) == len(b_tokens), f"{label}: lengths differ: {a_tokens} vs {b_tokens}"
    return True
