"""``moe``: a mixture-of-experts model with Qwen3-30B-A3B's layer shape (hidden 2048, 32 heads, 4 KV
heads, head dim 128, 128 experts of width 768, 8 per token, top-k renormalised, vocabulary 151936)
and random weights, written by transformers from a config (:func:`pagedllm_bench.moe.save_random_moe`).
The full model has 48 layers (61 GB in bf16, more than the machine's disk); the section keeps the
layer shape and takes ``num_layers`` of them (default 8: 11 GB), so that every per-layer figure is
the real model's.

Measured: the engine on the workload's requests (``LLM.generate``, EOS ignored); transformers'
continuous batching (the manager behind ``generate_batch``, per-request ``max_new_tokens``,
time-bounded; :func:`sections.hf.run_hf_continuous_batching`) and the engine on the same first
``hf_requests`` requests; then decode steps with ``decode_running`` requests running against their
floor: the bytes a step must read (the weights outside the experts, the experts the batch's tokens
are expected to reach under uniform routing, the KV cache of every running request) over the
bandwidth of a device copy.
"""

from __future__ import annotations

import gc
import os
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pagedllm_bench.common import free_device_memory, synchronize
from pagedllm_bench.moe import moe_hf_config, parameter_counts, save_random_moe
from pagedllm_bench.workloads import BenchRequest

from .hf import run_hf_continuous_batching
from .roofline import copy_bandwidth
from .throughput import engine_run


@dataclass(frozen=True)
class MoeSettings:
    """Model shape and workload sizes of the section."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    vocab_size: int
    num_requests: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    hf_requests: int
    hf_timeout_s: float
    max_num_seqs: int
    max_model_len: int
    decode_running: int
    decode_prompt_len: int
    decode_steps: int
    copy_bytes: int


MOE_FULL = MoeSettings(
    num_layers=8,
    hidden_size=2048,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    num_experts=128,
    top_k=8,
    expert_intermediate_size=768,
    vocab_size=151936,
    num_requests=256,
    prompt_range=(100, 1024),
    output_range=(100, 1024),
    hf_requests=64,
    hf_timeout_s=120.0,
    max_num_seqs=256,
    max_model_len=2048,
    decode_running=256,
    decode_prompt_len=512,
    decode_steps=20,
    copy_bytes=1 << 30,
)

MOE_TINY = MoeSettings(
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    num_experts=8,
    top_k=2,
    expert_intermediate_size=32,
    vocab_size=49152,
    num_requests=6,
    prompt_range=(8, 32),
    output_range=(4, 12),
    hf_requests=3,
    hf_timeout_s=60.0,
    max_num_seqs=8,
    max_model_len=128,
    decode_running=4,
    decode_prompt_len=16,
    decode_steps=4,
    copy_bytes=16 << 20,
)


def moe_requests(settings: MoeSettings, vocab: int, seed: int) -> list[BenchRequest]:
    """Random-token prompts (ids below ``vocab``) with lengths drawn from the settings' ranges."""
    rng = random.Random(seed)
    return [
        BenchRequest(
            [rng.randrange(100, vocab) for _ in range(rng.randint(*settings.prompt_range))],
            rng.randint(*settings.output_range),
        )
        for _ in range(settings.num_requests)
    ]


def expected_experts_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """Experts of one layer that ``tokens`` tokens reach on average when each picks ``top_k`` of
    ``num_experts`` uniformly at random."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def decode_floor(
    settings: MoeSettings, weight_bytes: int, expert_bytes: int, kv_bytes_per_token: int, context_tokens: int
) -> dict[str, float]:
    """Bytes one decode step of ``decode_running`` requests must read."""
    experts = expected_experts_touched(settings.num_experts, settings.top_k, settings.decode_running)
    all_experts = settings.num_layers * settings.num_experts * expert_bytes
    touched = settings.num_layers * experts * expert_bytes
    return {
        "experts_touched_per_layer": experts,
        "weight_bytes": float(weight_bytes - all_experts + touched),
        "kv_bytes": float(kv_bytes_per_token * context_tokens),
    }


def decode_steps(llm: Any, settings: MoeSettings, seed: int) -> dict[str, Any]:
    """Seconds per decode step with ``decode_running`` requests running (greedy, consecutive steps),
    and the tokens of context they read."""
    from pagedllm import RequestOutputKind, SamplingParams

    engine = llm.llm_engine
    engine.reset_prefix_cache()
    rng = random.Random(seed + 7)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=settings.decode_steps + 8,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    ids = [f"moe-decode-{i}" for i in range(settings.decode_running)]
    for rid in ids:
        engine.add_request(
            rid, [rng.randrange(100, 40000) for _ in range(settings.decode_prompt_len)], params
        )
    sched = engine.scheduler
    for _ in range(10_000):
        if not (sched.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running)):
            break
        engine.step()
    engine.step()
    running = sched.num_running
    context = sum(r.num_computed_tokens + 1 for r in sched.running)
    synchronize(engine.device)
    t = time.perf_counter()
    for _ in range(settings.decode_steps):
        engine.step()
    synchronize(engine.device)
    step_s = (time.perf_counter() - t) / settings.decode_steps
    while engine.has_unfinished_requests():
        engine.step()
    return {"running": running, "context_tokens": context, "step_s": step_s}


def section_moe(
    settings: MoeSettings,
    device: torch.device,
    dtype: torch.dtype,
    workdir: str,
    seed: int = 0,
    temperature: float = 0.0,
    skip_hf: bool = False,
) -> dict[str, Any]:
    """Write the model, then run the engine, transformers and the decode steps (module docstring)."""
    from pagedllm import LLM

    dtype_name = str(dtype).removeprefix("torch.")
    config = moe_hf_config(
        "qwen3_moe",
        vocab_size=settings.vocab_size,
        hidden_size=settings.hidden_size,
        num_layers=settings.num_layers,
        num_heads=settings.num_heads,
        num_kv_heads=settings.num_kv_heads,
        num_experts=settings.num_experts,
        top_k=settings.top_k,
        expert_intermediate_size=settings.expert_intermediate_size,
        head_dim=settings.head_dim,
        max_position_embeddings=settings.max_model_len,
    )
    t0 = time.perf_counter()
    model_dir = save_random_moe(config, os.path.join(workdir, "qwen3-moe-random"), dtype, seed, device)
    free_device_memory(device)
    out: dict[str, Any] = {
        "settings": asdict(settings),
        "dtype": dtype_name,
        "parameters": parameter_counts(config, "qwen3_moe"),
        "write_model_s": time.perf_counter() - t0,
    }
    requests = moe_requests(settings, 49152, seed)  # ids the default tokenizer knows
    t0 = time.perf_counter()
    llm = LLM(
        model_dir,
        dtype=dtype_name,
        device=str(device),
        max_num_seqs=settings.max_num_seqs,
        max_model_len=settings.max_model_len,
        seed=seed,
    )
    out["startup_s"] = time.perf_counter() - t0
    engine = llm.llm_engine
    runner = engine.runner
    warm = [r.prompt_token_ids[:16] for r in requests[:4]]
    from pagedllm import SamplingParams

    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    engine.reset_prefix_cache()
    out["engine"] = engine_run(llm, requests, temperature)
    out["engine"]["complete"] = out["engine"]["output_tokens"] == out["engine"]["expected_output_tokens"]
    engine.reset_prefix_cache()
    hf_subset = requests[: settings.hf_requests]
    out["engine_hf_subset"] = engine_run(llm, hf_subset, temperature)

    steps = decode_steps(llm, settings, seed)
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    expert_bytes = (
        3
        * settings.hidden_size
        * settings.expert_intermediate_size
        * torch.empty(0, dtype=dtype).element_size()
    )
    floor = decode_floor(
        settings,
        weight_bytes,
        expert_bytes,
        runner.kv_bytes_per_block // engine.config.block_size,
        steps["context_tokens"],
    )
    del llm, engine, runner
    gc.collect()
    free_device_memory(device)
    bandwidth = copy_bandwidth(device, settings.copy_bytes)
    bytes_per_s = float(bandwidth["bytes_per_s"])
    floor_s = (floor["weight_bytes"] + floor["kv_bytes"]) / bytes_per_s
    out["decode"] = {
        **steps,
        **floor,
        "copy_bandwidth_bytes_per_s": bytes_per_s,
        "floor_s": floor_s,
        "fraction_of_roofline": floor_s / steps["step_s"],
    }
    if not skip_hf:
        max_batch_tokens = max(r.prompt_len for r in hf_subset) + settings.max_num_seqs
        hf = run_hf_continuous_batching(
            model_dir, hf_subset, device, dtype, temperature, max_batch_tokens, settings.hf_timeout_s, seed
        )
        out["hf"] = hf
        out["engine_over_hf_output_tokens_per_s"] = (
            out["engine_hf_subset"]["output_tokens_per_s"] / hf["output_tokens_per_s"]
            if hf.get("output_tokens_per_s")
            else None
        )
    return out


def summary_rows(result: dict[str, Any]) -> list[list[Any]]:
    """``[figure, value]`` rows for the printed table."""
    rows: list[list[Any]] = [
        ["engine output tok/s", result["engine"]["output_tokens_per_s"]],
        ["engine output tok/s (hf subset)", result["engine_hf_subset"]["output_tokens_per_s"]],
    ]
    if "hf" in result:
        rows.append(["transformers generate_batch output tok/s", result["hf"]["output_tokens_per_s"]])
        rows.append(["engine / transformers", result.get("engine_over_hf_output_tokens_per_s")])
    decode = result["decode"]
    rows.append([f"decode step ms ({decode['running']} running)", 1e3 * decode["step_s"]])
    rows.append(["decode floor ms", 1e3 * decode["floor_s"]])
    rows.append(["fraction of roofline", decode["fraction_of_roofline"]])
    return rows
