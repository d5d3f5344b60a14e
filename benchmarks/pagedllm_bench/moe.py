"""``pagedllm bench moe``: offline throughput of a mixture-of-experts model against transformers.

The model is made here: a transformers Mixtral (or Qwen2-MoE / Qwen3-MoE) config of the given shape
(default: 8 layers, hidden 512, 8 experts of width 1792, 2 per token, Mixtral's 3.5x expert width),
random weights, the default model's tokenizer and vocabulary, saved as a float32 safetensors folder in
a temporary directory. The workload is ``--num-requests`` random-token prompts of mixed lengths with
mixed output lengths (EOS ignored, greedy). Timed in one run, alternating: the engine, transformers'
``generate`` on padded static batches of ``--baseline-batch-size`` (:func:`pagedllm_bench.baselines.run_hf_static`),
the engine again; the engine's figure is the mean of its two times. Reported: output tokens/s of
each and their ratio.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import random
import tempfile
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm_bench import baselines as baselines_module
from pagedllm_bench.common import (
    add_run_args,
    format_table,
    machine_info,
    now_iso,
    peak_rss_mib,
    ratio,
    run_at_log_level,
    set_num_threads,
    write_json,
)
from pagedllm_bench.throughput import run_engine, with_mean_time
from pagedllm_bench.workloads import BenchRequest, Workload

logger = logging.getLogger("pagedllm_bench")

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


def moe_hf_config(
    family: str,
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    num_experts: int,
    top_k: int,
    expert_intermediate_size: int,
    head_dim: int | None = None,
    max_position_embeddings: int = 4096,
) -> Any:
    """A transformers config of ``family`` ("mixtral", "qwen2_moe" or "qwen3_moe") with this shape.

    Qwen2-MoE gets a shared expert four experts wide, as Qwen1.5-MoE has; Qwen3-MoE renormalises
    its top-k weights (``norm_topk_prob``), as Qwen3-30B-A3B does."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "num_experts_per_tok": top_k,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    if head_dim is not None:
        common["head_dim"] = head_dim
    if family == "mixtral":
        return MixtralConfig(
            num_local_experts=num_experts, intermediate_size=expert_intermediate_size, **common
        )
    if family == "qwen2_moe":
        return Qwen2MoeConfig(
            num_experts=num_experts,
            moe_intermediate_size=expert_intermediate_size,
            shared_expert_intermediate_size=4 * expert_intermediate_size,
            intermediate_size=4 * expert_intermediate_size,
            **common,
        )
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            num_experts=num_experts,
            moe_intermediate_size=expert_intermediate_size,
            intermediate_size=4 * expert_intermediate_size,
            norm_topk_prob=True,
            **common,
        )
    raise ValueError(f"unknown MoE family {family!r}; choose from {', '.join(FAMILIES)}.")


def save_random_moe(
    config: Any,
    out_dir: str,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> str:
    """Save a random-weight model of ``config`` (transformers' initialisation, made on ``device``)
    with the default model's tokenizer into ``out_dir``; returns ``out_dir``."""
    from transformers import AutoModelForCausalLM

    from pagedllm.model.loader import default_model_path
    from pagedllm.model.tokenizer import load_gguf_tokenizer

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, **baselines_module.hf_dtype(dtype))
    model.save_pretrained(out_dir)
    del model
    gc.collect()
    load_gguf_tokenizer(default_model_path()).save_pretrained(out_dir)
    return out_dir


def mixed_workload(
    num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int
) -> Workload:
    """``num_requests`` random-token prompts (ids from 100 up, clear of special tokens) with prompt
    and output lengths drawn uniformly from the inclusive ranges."""
    rng = random.Random(seed)
    requests = [
        BenchRequest(
            [rng.randrange(100, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range)
        )
        for _ in range(num_requests)
    ]
    params = {"prompt_range": list(prompt_range), "output_range": list(output_range), "seed": seed}
    return Workload("moe-mixed", requests, params)


def parameter_counts(config: Any, family: str) -> dict[str, int]:
    """Total parameters and those one token reads (active: ``top_k`` experts, not all of them);
    norm weights are left out."""
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = config.num_key_value_heads * head_dim
    attention = h * heads * head_dim * 2 + 2 * h * kv
    if family == "qwen2_moe":  # q/k/v biases
        attention += heads * head_dim + 2 * kv
    experts = config.num_local_experts if family == "mixtral" else config.num_experts
    width = config.intermediate_size if family == "mixtral" else config.moe_intermediate_size
    expert = 3 * h * width
    shared = 3 * h * config.shared_expert_intermediate_size + h if family == "qwen2_moe" else 0
    router = h * experts
    embed = 2 * vocab * h
    total = embed + layers * (attention + router + experts * expert + shared)
    active = embed + layers * (attention + router + config.num_experts_per_tok * expert + shared)
    return {"total": total, "active_per_token": active}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model (random weights, made by the benchmark)")
    group.add_argument(
        "--family", choices=FAMILIES, default="mixtral", help="Architecture (default mixtral)."
    )
    group.add_argument("--hidden-size", type=int, default=512)
    group.add_argument("--num-layers", type=int, default=8)
    group.add_argument("--num-heads", type=int, default=8)
    group.add_argument("--num-kv-heads", type=int, default=2)
    group.add_argument("--num-experts", type=int, default=8)
    group.add_argument("--top-k", type=int, default=2, help="Experts per token (default 2).")
    group.add_argument(
        "--expert-intermediate-size", type=int, default=1792, help="Width of each expert (default 1792)."
    )
    group = parser.add_argument_group("workload")
    group.add_argument("--num-requests", type=int, default=32)
    group.add_argument("--min-prompt-len", type=int, default=16)
    group.add_argument("--max-prompt-len", type=int, default=256)
    group.add_argument("--min-output-len", type=int, default=16)
    group.add_argument("--max-output-len", type=int, default=128)
    group.add_argument("--workload-seed", type=int, default=0)
    group.add_argument(
        "--baseline-batch-size", type=int, default=16, help="Rows per padded transformers batch (default 16)."
    )
    group.add_argument(
        "--engine-after-baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Run the engine again after the baseline and report the mean of its two times (default on).",
    )
    add_run_args(parser, warmup=True)


def _check(args: argparse.Namespace) -> None:
    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "num_experts", "top_k"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1.")
    if args.expert_intermediate_size < 1 or args.num_requests < 1 or args.baseline_batch_size < 1:
        raise ValueError(
            "--expert-intermediate-size, --num-requests and --baseline-batch-size must be at least 1."
        )
    if args.top_k > args.num_experts:
        raise ValueError(f"--top-k ({args.top_k}) exceeds --num-experts ({args.num_experts}).")
    if (
        not 1 <= args.min_prompt_len <= args.max_prompt_len
        or not 1 <= args.min_output_len <= args.max_output_len
    ):
        raise ValueError("prompt and output length ranges need 1 <= min <= max.")
    if args.model is not None:
        raise ValueError("bench moe makes its own model; --model is not used.")


def run(args: argparse.Namespace) -> int:
    return run_at_log_level(args, _run)


def _run(args: argparse.Namespace) -> int:
    try:
        _check(args)
        set_num_threads(args.num_threads)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    from pagedllm.model.loader import default_model_path
    from pagedllm.model.tokenizer import load_gguf_tokenizer
    from pagedllm_bench.throughput import pad_token_id_for

    vocab = len(load_gguf_tokenizer(default_model_path()))
    hf_config = moe_hf_config(
        args.family,
        vocab_size=vocab,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        num_experts=args.num_experts,
        top_k=args.top_k,
        expert_intermediate_size=args.expert_intermediate_size,
        max_position_embeddings=max(1024, args.max_prompt_len + args.max_output_len),
    )
    counts = parameter_counts(hf_config, args.family)
    workload = mixed_workload(
        args.num_requests,
        (args.min_prompt_len, args.max_prompt_len),
        (args.min_output_len, args.max_output_len),
        vocab,
        args.workload_seed,
    )
    print(
        f"{args.family}: {args.num_layers} layers, hidden {args.hidden_size}, {args.num_experts} experts of "
        f"{args.expert_intermediate_size}, top-{args.top_k}; {counts['total'] / 1e6:.0f}M parameters "
        f"({counts['active_per_token'] / 1e6:.0f}M active). Workload: {len(workload.requests)} requests, "
        f"{workload.num_prompt_tokens} prompt and {workload.num_output_tokens} output tokens."
    )
    with tempfile.TemporaryDirectory(prefix="pagedllm-bench-moe-") as tmp:
        path = save_random_moe(hf_config, os.path.join(tmp, args.family))
        config = EngineConfig.from_cli_args(args, model=path, dtype="float32")
        engine = LLMEngine.from_config(config)
        first = run_engine(engine, workload, 0.0, True, args.warmup).metrics(workload)
        device = str(engine.device)
        eos_ids = list(engine.eos_token_ids)
        if not args.engine_after_baseline:
            del engine
            gc.collect()
        hf_model = baselines_module.load_hf_model(path, device)
        baseline = baselines_module.run_hf_static(
            hf_model,
            workload.requests,
            args.baseline_batch_size,
            eos_token_ids=eos_ids,
            pad_token_id=pad_token_id_for(hf_model, eos_ids),
            warmup=args.warmup,
        ).as_dict()
        del hf_model
        gc.collect()
        ours = first
        if args.engine_after_baseline:
            engine.reset_prefix_cache()
            second = run_engine(engine, workload, 0.0, True, args.warmup).metrics(workload)
            ours = with_mean_time(first, second)
            del engine
            gc.collect()
    speedup = ratio(ours["output_tokens_per_s"], baseline["output_tokens_per_s"])
    rows = [
        ["pagedllm", ours["output_tokens_per_s"], ours["elapsed_s"]],
        [
            f"transformers static x{args.baseline_batch_size}",
            baseline["output_tokens_per_s"],
            baseline["elapsed_s"],
        ],
    ]
    print(format_table(["system", "output tok/s", "seconds"], rows))
    print(f"pagedllm / transformers output tok/s: {speedup:.2f}x" if speedup else "ratio unavailable")
    if args.output_json:
        write_json(
            args.output_json,
            {
                "benchmark": "moe",
                "date": now_iso(),
                "machine": machine_info(),
                "peak_rss_mib": peak_rss_mib(),
                "model": {
                    "family": args.family,
                    "hidden_size": args.hidden_size,
                    "num_layers": args.num_layers,
                    "num_heads": args.num_heads,
                    "num_kv_heads": args.num_kv_heads,
                    "num_experts": args.num_experts,
                    "top_k": args.top_k,
                    "expert_intermediate_size": args.expert_intermediate_size,
                    "vocab_size": vocab,
                    "parameters": counts,
                },
                "workload": workload.summary(),
                "systems": {"pagedllm": ours, "hf-static": baseline},
                "ratios": {"output_tokens_per_s": speedup},
            },
        )
        print(f"Wrote {args.output_json}")
    return 0
