"""``pagedllm bench multiprocess``: the cost of running the engine in a core process, offline.

The same workload (by default the 64 random requests of ``bench throughput``) runs through
``LLM.generate`` with the engine in this process and with ``LLM(multiprocess=True)`` (one engine-core
process; this process tokenizes, sends, and adds up the output deltas). The two alternate for
``--pairs`` pairs, each run timed from the first request sent to the last output received (model
loading and a warm-up request outside), and the ratio of output tokens/s is reported per pair and
as the mean, with whether the two gave the same tokens. Both engines live for the whole benchmark
(loaded once each) so that the pairs differ only in where the engine runs.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm_bench.common import (
    add_run_args,
    machine_info,
    now_iso,
    run_at_log_level,
    set_num_threads,
    write_json,
)
from pagedllm_bench.workloads import Workload, add_workload_args, build_workload

logger = logging.getLogger("pagedllm_bench")


@dataclass
class TimedRun:
    """One timed ``generate`` of the workload."""

    mode: str  # "in-process" or "multiprocess"
    elapsed_s: float
    output_tokens: int
    token_ids: list[list[int]]

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s


def _timed(llm: Any, mode: str, workload: Workload, temperature: float) -> TimedRun:
    from pagedllm import SamplingParams

    prompts = [r.prompt_token_ids for r in workload.requests]
    params = [
        SamplingParams(temperature=temperature, max_tokens=r.output_len, ignore_eos=True, seed=i)
        for i, r in enumerate(workload.requests)
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    ids = [list(o.outputs[0].token_ids) for o in outputs]
    return TimedRun(mode, elapsed, sum(len(t) for t in ids), ids)


def compare(config: EngineConfig, workload: Workload, pairs: int, temperature: float = 0.0) -> dict[str, Any]:
    """Alternate in-process and multi-process runs of ``workload``; the per-pair ratios and runs."""
    import dataclasses

    from pagedllm import LLM, SamplingParams

    args = {k: v for k, v in dataclasses.asdict(config).items() if k != "model"}
    engines = {
        "in-process": LLM(config.model, **args),
        "multiprocess": LLM(config.model, multiprocess=True, **args),
    }
    try:
        for llm in engines.values():  # warm-up, then an empty prefix cache for every timed run
            llm.generate(
                [[11, 12, 13, 14, 15, 16, 17, 18]],
                SamplingParams(max_tokens=2, temperature=0),
                use_tqdm=False,
            )
        runs: list[TimedRun] = []
        for pair in range(pairs):
            order = ["in-process", "multiprocess"] if pair % 2 == 0 else ["multiprocess", "in-process"]
            for mode in order:
                _reset_prefix_cache(engines[mode])
                runs.append(_timed(engines[mode], mode, workload, temperature))
                logger.info("pair %d %s: %.1f output tok/s", pair, mode, runs[-1].output_tok_s)
    finally:
        engines["multiprocess"].shutdown()
    ratios = []
    for pair in range(pairs):
        both = {r.mode: r for r in runs[2 * pair : 2 * pair + 2]}
        ratios.append(both["multiprocess"].output_tok_s / both["in-process"].output_tok_s)
    reference = runs[0].token_ids
    return {
        "ratios": ratios,
        "mean_ratio": statistics.fmean(ratios),
        "identical_tokens": all(r.token_ids == reference for r in runs),
        "runs": [
            {
                "mode": r.mode,
                "elapsed_s": r.elapsed_s,
                "output_tokens": r.output_tokens,
                "output_tok_s": r.output_tok_s,
            }
            for r in runs
        ],
    }


def _reset_prefix_cache(llm: Any) -> None:
    """Start a timed run with nothing cached (every pair runs the same prompts)."""
    llm.llm_engine.reset_prefix_cache()


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, prefix=False, dataset=False)
    parser.add_argument(
        "--pairs", type=int, default=3, help="Alternating in-process/multi-process pairs (default 3)."
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="Sampling temperature (default 0: greedy)."
    )
    add_run_args(parser)


def _run(args: argparse.Namespace) -> int:
    from pagedllm.model.loader import load_model_tokenizer

    if args.pairs < 1:
        raise ValueError(f"--pairs must be at least 1, got {args.pairs}.")
    set_num_threads(args.num_threads)
    config = EngineConfig.from_cli_args(args)
    tokenizer = load_model_tokenizer(config.model, config.tokenizer)
    exclude = {t for t in (tokenizer.eos_token_id, tokenizer.bos_token_id) if t is not None}
    workload = build_workload(args, len(tokenizer), tokenizer, exclude)
    result = compare(config, workload, args.pairs, args.temperature)
    for run in result["runs"]:
        print(f"{run['mode']:>13}: {run['elapsed_s']:7.2f} s  {run['output_tok_s']:8.1f} output tok/s")
    ratios = ", ".join(f"{r:.3f}" for r in result["ratios"])
    print(f"multiprocess / in-process output tok/s: {result['mean_ratio']:.3f} (pairs: {ratios})")
    print(f"identical tokens: {result['identical_tokens']}")
    if args.output_json:
        write_json(
            args.output_json,
            {
                "benchmark": "multiprocess",
                "time": now_iso(),
                "machine": machine_info(),
                "workload": workload.summary(),
                **result,
            },
        )
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        return run_at_log_level(args, _run)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2


__all__ = ["TimedRun", "add_cli_args", "compare", "run"]
