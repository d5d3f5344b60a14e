"""Greedy generation with HF transformers as the reference, and vLLM's rule for comparing with it.

Two greedy sequences agree when their tokens are equal, or when at the first difference each side's
token is among the other side's top logprobs (a near-tie flipped); past that point they may diverge.
"""

from __future__ import annotations

from typing import Any

import torch


@torch.inference_mode()
def hf_greedy(
    model: Any, prompt_ids: list[int], max_new_tokens: int, top_k: int = 5
) -> tuple[list[int], list[dict[int, float]]]:
    """HF greedy generation with the top-k logprobs of the raw logits at each step."""
    ids = torch.tensor([prompt_ids], device=model.device)
    pad = model.generation_config.eos_token_id
    if isinstance(pad, list):
        pad = pad[0]
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0 if pad is None else pad,
    )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    tops = []
    for step_logits in out.logits:
        lp = torch.log_softmax(step_logits[0].float(), dim=-1)
        values, idx = lp.topk(top_k)
        tops.append({int(i): float(v) for i, v in zip(idx.tolist(), values.tolist(), strict=True)})
    return tokens, tops


def greedy_compare(
    a_tokens: list[int],
    a_top: list[dict[int, Any]],
    b_tokens: list[int],
    b_top: list[dict[int, Any]],
) -> tuple[str, int | None]:
    """``("identical" | "near_tie" | "mismatch", first differing index)``.

    Only the common length is compared (one side may have stopped at EOS).
    """
    for i in range(min(len(a_tokens), len(b_tokens))):
        if a_tokens[i] != b_tokens[i]:
            close = a_tokens[i] in b_top[i] and b_tokens[i] in a_top[i]
            return ("near_tie" if close else "mismatch"), i
    return "identical", None
