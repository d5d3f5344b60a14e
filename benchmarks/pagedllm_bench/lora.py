"""``pagedllm bench lora``: requests spread over several LoRA adapters against the same requests on
the base model alone, plus the time and memory one adapter takes to load.

The adapters are written by the benchmark (PEFT folders of random weights, rank ``--lora-rank``, every
projection targeted) for the model under test. Both systems run the same seeded random-token requests,
all added at once, EOS ignored, greedy: the base system is the engine as users run it without adapters
(``enable_lora`` off: the native decode layers on); the LoRA system has ``enable_lora`` with
``max_loras`` = ``--num-adapters`` and sends request ``i`` to adapter ``i mod --num-adapters``. The
figure is LoRA output tok/s over base output tok/s: the systems run ``--pairs`` times, alternated (this
machine's speed drifts), and the median of the pairs' ratios is reported. Loading: the seconds the engine's registry takes
to read and check a fresh adapter (first use), and its bytes in host memory against its file.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.lora_request import LoRARequest
from pagedllm.model.config import ModelConfig
from pagedllm.sampling_params import SamplingParams
from pagedllm_bench.common import (
    add_run_args,
    format_table,
    machine_info,
    now_iso,
    ratio,
    run_at_log_level,
    set_num_threads,
    write_json,
)
from pagedllm_bench.workloads import Workload, parse_range, random_workload

logger = logging.getLogger(__name__)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64, help="Requests, all added at once.")
    parser.add_argument("--num-adapters", type=int, default=4, help="Adapters the requests are spread over.")
    parser.add_argument("--lora-rank", type=int, default=16, help="Rank of every adapter.")
    parser.add_argument(
        "--pairs",
        type=int,
        default=3,
        help="Runs of each system, alternated; the figure is the median ratio.",
    )
    parser.add_argument(
        "--input-len", type=parse_range, default=(64, 128), help="Prompt tokens, N or MIN:MAX."
    )
    parser.add_argument(
        "--output-len", type=parse_range, default=(64, 128), help="Output tokens, N or MIN:MAX."
    )
    add_run_args(parser, warmup=False)
    parser.set_defaults(max_num_seqs=64, max_model_len=512, num_kv_blocks=2048)


def write_adapter(folder: Path, cfg: ModelConfig, rank: int, seed: int) -> str:
    """A PEFT LoRA folder for a model of ``cfg``: every projection of every layer, random weights."""
    gen = torch.Generator().manual_seed(seed)
    h, q, kv, ffn = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes = {
        "self_attn.q_proj": (q, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q),
        "mlp.gate_proj": (ffn, h),
        "mlp.up_proj": (ffn, h),
        "mlp.down_proj": (h, ffn),
    }
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module, (out_f, in_f) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) / in_f**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS)}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


@dataclasses.dataclass
class LoRARun:
    seconds: float
    output_tok_s: float


def run_system(config: EngineConfig, workload: Workload, loras: list[LoRARequest | None]) -> LoRARun:
    """Run every request of ``workload`` at once (request ``i`` with ``loras[i % len(loras)]``)."""
    engine = LLMEngine.from_config(config)
    try:
        started = time.perf_counter()
        for i, r in enumerate(workload.requests):
            params = SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
            engine.add_request(str(i), r.prompt_token_ids, params, lora_request=loras[i % len(loras)])
        tokens = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens += len(out.outputs[0].token_ids)
        seconds = time.perf_counter() - started
        engine.check_idle()
        return LoRARun(seconds, tokens / seconds)
    finally:
        engine.shutdown()
        del engine
        gc.collect()


def measure_loading(config: EngineConfig, folder: Path, rank: int, count: int = 3) -> dict[str, float]:
    """Seconds to read and check a fresh adapter (median of ``count``), its bytes held and on disk."""
    engine = LLMEngine.from_config(config)
    try:
        lora = engine.executor.lora
        assert lora is not None
        times, held = [], 0
        for i in range(count):
            path = write_adapter(folder / f"load{i}", engine.model_config, rank, 1000 + i)
            started = time.perf_counter()
            adapter = lora.registry.get(LoRARequest(f"load{i}", 1000 + i, path))
            times.append(time.perf_counter() - started)
            held = adapter.nbytes
        file_bytes = os.path.getsize(Path(path) / "adapter_model.safetensors")
        return {
            "load_seconds": sorted(times)[len(times) // 2],
            "adapter_bytes": held,
            "file_bytes": file_bytes,
            "slot_bytes": lora.slot_bytes,
        }
    finally:
        engine.shutdown()
        del engine
        gc.collect()


def run(args: argparse.Namespace) -> int:
    return run_at_log_level(args, _run)


def _run(args: argparse.Namespace) -> int:
    try:
        set_num_threads(args.num_threads)
        if args.num_adapters < 1 or args.lora_rank < 1:
            raise ValueError("--num-adapters and --lora-rank must be at least 1.")
        base = dataclasses.replace(EngineConfig.from_cli_args(args), enable_lora=False)
        with_lora = dataclasses.replace(
            base,
            enable_lora=True,
            max_loras=args.num_adapters,
            max_lora_rank=max(args.lora_rank, base.max_lora_rank),
        )
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    probe = LLMEngine.from_config(base)
    tokenizer, cfg = probe.tokenizer, probe.model_config
    probe.shutdown()
    del probe
    gc.collect()
    workload = random_workload(
        args.num_prompts,
        args.input_len,
        args.output_len,
        len(tokenizer),
        args.seed,
        tokenizer.all_special_ids,
    )
    with tempfile.TemporaryDirectory(prefix="pagedllm-lora-bench-") as tmp:
        root = Path(tmp)
        adapters: list[LoRARequest | None] = [
            LoRARequest(f"adapter{i}", i + 1, write_adapter(root / f"a{i}", cfg, args.lora_rank, i))
            for i in range(args.num_adapters)
        ]
        pairs: list[tuple[LoRARun, LoRARun]] = []
        for _ in range(args.pairs):
            pairs.append((run_system(base, workload, [None]), run_system(with_lora, workload, adapters)))
        loading = measure_loading(with_lora, root, args.lora_rank)
    ratios = sorted(r for b, lo in pairs if (r := ratio(lo.output_tok_s, b.output_tok_s)) is not None)
    share = ratios[len(ratios) // 2] if ratios else None
    print(
        f"Workload: {args.num_prompts} requests at once, prompts {args.input_len[0]}-{args.input_len[1]} and outputs "
        f"{args.output_len[0]}-{args.output_len[1]} tokens; {args.num_adapters} adapters of rank {args.lora_rank} "
        "on every projection"
    )
    rows = []
    for i, (b, lo) in enumerate(pairs):
        rows.append([f"{i + 1}: base model (no adapters)", b.seconds, b.output_tok_s])
        rows.append(
            [f"{i + 1}: {args.num_adapters} adapters, one per request in turn", lo.seconds, lo.output_tok_s]
        )
    print(format_table(["run", "seconds", "output tok/s"], rows))
    shares = ", ".join(f"{r:.1%}" for r in ratios)
    print(
        f"Adapters against the base model: median {share:.1%} of its output tok/s ({shares})"
        if share
        else "no figure"
    )
    print(
        f"Loading a rank-{args.lora_rank} adapter: {loading['load_seconds']:.3f} s; held "
        f"{loading['adapter_bytes'] / 2**20:.1f} MiB (file {loading['file_bytes'] / 2**20:.1f} MiB); "
        f"slots of every adapter {loading['slot_bytes'] / 2**20:.1f} MiB"
    )
    if args.output_json:
        write_json(
            args.output_json,
            {
                "benchmark": "lora",
                "date": now_iso(),
                "machine": machine_info(),
                "workload": workload.summary(),
                "num_adapters": args.num_adapters,
                "lora_rank": args.lora_rank,
                "pairs": [{"base": dataclasses.asdict(b), "lora": dataclasses.asdict(lo)} for b, lo in pairs],
                "shares": ratios,
                "share": share,
                "loading": loading,
            },
        )
        print(f"\nWrote {args.output_json}")
    return 0


__all__ = ["add_cli_args", "run", "write_adapter"]
