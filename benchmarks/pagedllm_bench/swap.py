"""``pagedllm bench swap``: preemption by swapping to the host tier (``--preemption-mode auto`` with
``--swap-space``) against recompute, on a workload whose KV cannot all fit on the device.

Both systems run the same seeded random-token requests, all added at once, EOS ignored, greedy; the
device pool (``--num-kv-blocks``) holds a fraction of what the running requests need, so requests are
preempted again and again. Reported per system: the time to finish everything, output tok/s,
preemptions, swaps and bytes copied; the figure is recompute time over auto time (above 1: auto is
quicker).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import time
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.model.loader import load_model_tokenizer
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


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=32, help="Requests, all added at once.")
    parser.add_argument(
        "--input-len", type=parse_range, default=(256, 512), help="Prompt tokens, N or MIN:MAX."
    )
    parser.add_argument(
        "--output-len", type=parse_range, default=(128, 256), help="Output tokens, N or MIN:MAX."
    )
    add_run_args(parser, warmup=False)
    # A device pool of 2,048 tokens for 32 requests of up to 768: preemption all along.
    parser.set_defaults(num_kv_blocks=128, swap_space=2.0, max_num_seqs=32, max_model_len=1024)


@dataclasses.dataclass
class SwapRun:
    """One system's run of the workload."""

    seconds: float  # from the first request added to the last finished
    output_tok_s: float
    tokens: list[list[int]]  # greedy output tokens per request
    stats: dict[str, int]  # preemptions, swaps, bytes copied


def run_system(config: EngineConfig, workload: Workload) -> SwapRun:
    """Run every request of ``workload`` at once on an engine built from ``config``."""
    engine = LLMEngine.from_config(config)
    try:
        started = time.perf_counter()
        for i, r in enumerate(workload.requests):
            params = SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
            engine.add_request(str(i), r.prompt_token_ids, params)
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        seconds = time.perf_counter() - started
        engine.check_idle()
        s = engine.get_stats()
        stats = {
            "preemptions": s.num_preemptions,
            "swapped_out": s.swapped_out,
            "swapped_in": s.swapped_in,
            "swap_out_bytes": s.swap_out_bytes,
            "swap_in_bytes": s.swap_in_bytes,
        }
        tokens = [done[str(i)] for i in range(len(workload.requests))]
        return SwapRun(seconds, sum(map(len, tokens)) / seconds, tokens, stats)
    finally:
        engine.shutdown()
        del engine
        gc.collect()


def run(args: argparse.Namespace) -> int:
    return run_at_log_level(args, _run)


def compare(base: EngineConfig, workload: Workload) -> dict[str, Any]:
    """Recompute against ``auto`` with the host tier of ``base.swap_space`` GiB: both runs, the
    ratio and whether the greedy tokens agree."""
    recompute = run_system(dataclasses.replace(base, preemption_mode="recompute", swap_space=0.0), workload)
    auto = run_system(dataclasses.replace(base, preemption_mode="auto"), workload)
    same = sum(a == b for a, b in zip(recompute.tokens, auto.tokens, strict=True))
    return {
        "systems": {
            name: {"seconds": r.seconds, "output_tok_s": r.output_tok_s, **r.stats}
            for name, r in (("recompute", recompute), ("auto", auto))
        },
        "speedup": ratio(recompute.seconds, auto.seconds),
        "same_tokens": same,
    }


def _run(args: argparse.Namespace) -> int:
    try:
        set_num_threads(args.num_threads)
        base = EngineConfig.from_cli_args(args)
        if not base.swap_space:
            raise ValueError("swap_space must be above 0: auto preemption swaps to the host tier.")
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    tokenizer = load_model_tokenizer(base.model, base.tokenizer)
    workload = random_workload(
        args.num_prompts,
        args.input_len,
        args.output_len,
        len(tokenizer),
        args.seed,
        tokenizer.all_special_ids,
    )
    result = compare(base, workload)
    systems = result["systems"]
    print(
        f"Workload: {args.num_prompts} requests at once, prompts {args.input_len[0]}-{args.input_len[1]} and "
        f"outputs {args.output_len[0]}-{args.output_len[1]} tokens; device pool {base.num_kv_blocks} blocks of "
        f"{base.block_size}; host tier {base.swap_space} GiB"
    )
    rows = [
        [
            name,
            s["seconds"],
            s["output_tok_s"],
            s["preemptions"],
            s["swapped_out"],
            s["swap_out_bytes"] / 2**20,
        ]
        for name, s in systems.items()
    ]
    print(format_table(["system", "seconds", "output tok/s", "preemptions", "swapped out", "MiB out"], rows))
    speedup = result["speedup"]
    print(f"auto against recompute: {speedup:.2f}x quicker" if speedup else "no figure")
    print(f"Same greedy tokens: {result['same_tokens']} of {len(workload.requests)} requests")
    if args.output_json:
        write_json(
            args.output_json,
            {
                "benchmark": "swap",
                "date": now_iso(),
                "machine": machine_info(),
                "workload": workload.summary(),
                **result,
            },
        )
        print(f"\nWrote {args.output_json}")
    return 0
