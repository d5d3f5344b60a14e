"""Pieces shared by the speculative-decoding engine tests: the two-sample chi-square test, the
sampled-token counts of a tiny-vocabulary model with and without speculation, and draft models
derived from a tiny target (a noisy copy: same architecture and vocabulary, partial agreement)."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.engine.observe.stats import EngineStats


def generated_tokens(
    llm: LLM, params: SamplingParams, prompts: list[Any], one_by_one: bool = False
) -> list[list[int]]:
    """The tokens of ``prompts`` (together, or one request at a time); the engine, with any draft
    model's pool, is checked idle after."""
    if one_by_one:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.check_idle()
    return [list(o.outputs[0].token_ids) for o in outs]


def chi2_homogeneity_pvalue(a: torch.Tensor, b: torch.Tensor) -> float:
    """p-value that two count vectors come from one distribution (categories seen on either side)."""
    keep = (a + b) > 0
    a, b = a[keep].double(), b[keep].double()
    total = a + b
    expected_a = total * a.sum() / total.sum()
    expected_b = total * b.sum() / total.sum()
    statistic = ((a - expected_a) ** 2 / expected_a + (b - expected_b) ** 2 / expected_b).sum()
    df = torch.tensor((len(a) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, statistic / 2))


# The sampled-distribution setup: 1,200 seeded requests over 40 prompts of a 16-token vocabulary, at
# temperature 1; the token at output position SAMPLED_POSITION is counted.
NUM_SAMPLED = 1200
SAMPLED_POSITION = 10
VOCAB16: dict[str, Any] = {"vocab_size": 16, "initializer_range": 1.0}


def sampled_token_counts(
    path: str, speculative_config: str | dict[str, Any] | None
) -> tuple[torch.Tensor, EngineStats]:
    """Counts (16 entries) of the token at output position 10 of the 1,200 seeded requests, and the
    engine's stats; the engine is checked idle and shut down."""
    prompts = [[1 + (i * 7 + j) % 15 for j in range(6)] for i in range(40)]
    llm = LLM(
        path, dtype="float32", max_model_len=64, num_kv_blocks=512, speculative_config=speculative_config
    )
    params = [
        SamplingParams(temperature=1.0, max_tokens=SAMPLED_POSITION + 2, seed=i, ignore_eos=True)
        for i in range(NUM_SAMPLED)
    ]
    outs = llm.generate([prompts[i % 40] for i in range(NUM_SAMPLED)], params, use_tqdm=False)
    llm.llm_engine.check_idle()
    stats = llm.llm_engine.get_stats()
    llm.shutdown()
    tokens = torch.tensor([o.outputs[0].token_ids[SAMPLED_POSITION] for o in outs])
    return torch.bincount(tokens, minlength=16), stats


def noisy_copy(src: str, dst: str, noise: float, seed: int = 1) -> str:
    """A copy of the tiny Hugging Face model in ``src`` whose every weight has Gaussian noise of
    ``noise`` times its own standard deviation added: a draft that agrees with the target often but
    not always. Returns ``dst``."""
    shutil.copytree(src, dst)
    weights_path = os.path.join(dst, "model.safetensors")
    weights = load_file(weights_path)
    generator = torch.Generator().manual_seed(seed)
    for name, w in weights.items():
        scale = float(w.float().std()) if w.numel() > 1 else 0.0
        weights[name] = w + torch.randn(w.shape, generator=generator, dtype=w.dtype) * noise * scale
    save_file(weights, weights_path, metadata={"format": "pt"})
    return dst


def with_config(src: str, dst: str, **changes: Any) -> str:
    """A copy of the model folder ``src`` whose ``config.json`` has ``changes`` (weights untouched)."""
    shutil.copytree(src, dst)
    config_path = os.path.join(dst, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(changes)
    with open(config_path, "w") as f:
        json.dump(config, f)
    return dst
