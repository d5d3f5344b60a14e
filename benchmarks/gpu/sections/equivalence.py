"""``equivalence``: greedy tokens with top-5 logprobs of the engine against transformers on the same
weights and dtype, by the logprob-close rule of :mod:`pagedllm_bench.hf_reference` (identical, or
at the first differing token each side's token is among the other's top 5); then the engine with
CUDA graphs against ``enforce_eager``. The text prompts are the test suite's
(``tests/helpers/prompts.py``)."""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from helpers.prompts import REFERENCE_PROMPTS
from pagedllm_bench.baselines import load_hf_model
from pagedllm_bench.common import free_device_memory
from pagedllm_bench.hf_reference import greedy_compare, hf_greedy

from .common import Settings


def engine_greedy(
    llm: Any, prompts: list[list[int]], max_tokens: int
) -> list[tuple[list[int], list[dict[int, float]]]]:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = []
    for out in outs:
        seq = out.outputs[0]
        tops = [{int(t): float(lp.logprob) for t, lp in step.items()} for step in seq.logprobs]
        result.append((list(seq.token_ids), tops))
    return result


def comparison_summary(statuses: list[tuple[str, int | None]]) -> dict[str, Any]:
    counts = {s: sum(1 for st, _ in statuses if st == s) for s in ("identical", "near_tie", "mismatch")}
    return {
        "passed": counts["mismatch"] == 0,
        **counts,
        "per_prompt": [{"status": s, "first_difference": i} for s, i in statuses],
    }


def small_engine_args(device: torch.device, dtype_name: str) -> dict[str, Any]:
    """Engine arguments for the equivalence checks: a small batch and a 2 GiB KV cache on GPUs."""
    args: dict[str, Any] = {
        "dtype": dtype_name,
        "device": str(device),
        "max_num_seqs": 8,
        "max_model_len": 512,
    }
    if device.type == "cuda":
        args["kv_cache_memory_bytes"] = 2 << 30
    return args


def section_equivalence(
    settings: Settings, device: torch.device, dtype_name: str, model_arg: str | None, random_prompts: bool
) -> dict[str, Any]:
    """The engine against transformers (and CUDA graphs against eager) on ``model_arg``'s greedy tokens.

    ``random_prompts``: seeded random token ids (for random-weight models) instead of text prompts.
    """
    from pagedllm import LLM
    from pagedllm.model.loader import resolve_model_path

    try:
        resolve_model_path(model_arg)
    except (FileNotFoundError, ValueError) as exc:
        return {"status": "skipped", "reason": str(exc)}
    t0 = time.perf_counter()
    dtype = getattr(torch, dtype_name)
    llm = LLM(model_arg, **small_engine_args(device, dtype_name))
    if random_prompts:
        rng = random.Random(5)
        vocab = llm.llm_engine.vocab_size
        prompts = [
            [rng.randrange(vocab) for _ in range(rng.randint(4, 40))]
            for _ in range(settings.equivalence_prompts)
        ]
    else:
        tokenizer = llm.get_tokenizer()
        prompts = [list(tokenizer(p).input_ids) for p in REFERENCE_PROMPTS[: settings.equivalence_prompts]]
    n = settings.equivalence_tokens
    ours = engine_greedy(llm, prompts, n)
    result: dict[str, Any] = {
        "model": model_arg or "default",
        "dtype": dtype_name,
        "max_tokens": n,
        "prompts": "random token ids" if random_prompts else "text",
    }

    hf = load_hf_model(model_arg, device, dtype)
    statuses = []
    first_step_err = 0.0
    for prompt, (tokens, tops) in zip(prompts, ours, strict=True):
        hf_tokens, hf_tops = hf_greedy(hf, prompt, n)
        statuses.append(greedy_compare(tokens, tops, hf_tokens, hf_tops))
        for tok, lp in hf_tops[0].items():
            if tok in tops[0]:
                first_step_err = max(first_step_err, abs(tops[0][tok] - lp))
    del hf
    free_device_memory(device)
    result["vs_hf"] = {**comparison_summary(statuses), "first_step_max_logprob_diff": first_step_err}

    if device.type == "cuda" and llm.llm_engine.runner.cuda_graphs is not None:
        eager = LLM(model_arg, enforce_eager=True, **small_engine_args(device, dtype_name))
        eager_out = engine_greedy(eager, prompts, n)
        graph_statuses = [
            greedy_compare(a_tok, a_top, b_tok, b_top)
            for (a_tok, a_top), (b_tok, b_top) in zip(ours, eager_out, strict=True)
        ]
        result["graphs_vs_eager"] = comparison_summary(graph_statuses)
        del eager
    else:
        result["graphs_vs_eager"] = {"status": "skipped", "reason": "CUDA graphs need a CUDA device"}
    del llm
    free_device_memory(device)
    checks = [result["vs_hf"]["passed"]]
    if "passed" in result["graphs_vs_eager"]:
        checks.append(result["graphs_vs_eager"]["passed"])
    result["passed"] = all(checks)
    result["status"] = "passed" if result["passed"] else "failed"
    result["seconds"] = time.perf_counter() - t0
    return result
