"""``pagedllm bench step-time``: what long prompts do to a running stream, with the step-time budget
(``--max-step-time-ms``) against the token budget alone.

One engine, in-process: ``--streams`` requests decode (EOS ignored) while ``--num-long`` prompts of
``--long-len`` random tokens arrive at once. Measured per run: the streams' inter-token gaps from the
long prompts' arrival until each has its first token (the longest, and the median), the long
prompts' time to first token, and, before they arrive, the median decode-only step. The two systems
run alternately (``--repeats`` times each) on the same engine, its step budget on (the target given,
or the device's default) or off, so that both meet the same machine state; figures are medians over
the repeats. The prefix cache is emptied between runs and every run draws new prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import statistics
import time
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm_bench.common import (
    add_run_args,
    format_table,
    machine_info,
    now_iso,
    run_at_log_level,
    set_num_threads,
    write_json,
)

logger = logging.getLogger(__name__)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--streams", type=int, default=1, help="Requests decoding while the long prompts come."
    )
    parser.add_argument("--num-long", type=int, default=1, help="Long prompts, arriving at once.")
    parser.add_argument("--long-len", type=int, default=8000, help="Tokens of each long prompt.")
    parser.add_argument(
        "--lead-steps", type=int, default=20, help="Decode steps before the long prompts come."
    )
    parser.add_argument("--repeats", type=int, default=2, help="Runs of each system, alternating.")
    add_run_args(parser, warmup=False)
    parser.set_defaults(max_model_len=8192, num_kv_blocks=1100)


@dataclasses.dataclass
class GapRun:
    """One run: the streams' gaps while the long prompts were prefilled, and their TTFTs (seconds)."""

    max_gap: float
    median_gap: float
    gaps: list[float]
    ttfts: list[float]
    decode_step: float  # median step with decodes only, before the long prompts came
    steps: int  # steps from the long prompts' arrival to their last first token


def measure(
    engine: LLMEngine, streams: int, num_long: int, long_len: int, lead_steps: int, rng: random.Random
) -> GapRun:
    """Run one scenario on ``engine`` (idle before and after): streams decode, long prompts arrive."""
    vocab = engine.vocab_size
    special = set(engine.eos_token_ids)

    def tokens(n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            t = rng.randrange(100, vocab)
            if t not in special:
                out.append(t)
        return out

    stream_params = SamplingParams(temperature=0, max_tokens=engine.max_model_len - 64, ignore_eos=True)
    stream_ids = [f"stream-{i}-{rng.random()}" for i in range(streams)]
    for rid in stream_ids:
        engine.add_request(rid, tokens(16), stream_params)
    last: dict[str, float] = {}
    lead: list[float] = []
    for _ in range(lead_steps):
        started = time.perf_counter()
        engine.step()
        lead.append(time.perf_counter() - started)
    long_ids = [f"long-{i}-{rng.random()}" for i in range(num_long)]
    arrived = time.perf_counter()
    for rid in long_ids:
        engine.add_request(rid, tokens(long_len), SamplingParams(temperature=0, max_tokens=1))
    ttfts: dict[str, float] = {}
    gaps: list[float] = []
    steps = 0
    while len(ttfts) < num_long:
        outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        for out in outputs:
            if out.request_id in long_ids and out.request_id not in ttfts:
                ttfts[out.request_id] = now - arrived
            elif out.request_id in stream_ids:
                gaps.append(now - last.get(out.request_id, arrived))
                last[out.request_id] = now
    engine.abort_request(stream_ids)
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()
    return GapRun(
        max(gaps, default=0.0),
        statistics.median(gaps) if gaps else 0.0,
        gaps,
        [ttfts[r] for r in long_ids],
        statistics.median(lead) if lead else 0.0,
        steps,
    )


def compare(engine: LLMEngine, args: argparse.Namespace) -> dict[str, Any]:
    """The two systems, alternating on one engine; returns each one's runs and medians."""
    budget = engine.scheduler.step_budget
    if budget is None:
        raise ValueError("the engine has no step-time target: give --max-step-time-ms above 0.")
    rng = random.Random(args.seed)
    runs: dict[str, list[GapRun]] = {"step budget": [], "token budget": []}
    for _ in range(args.repeats):
        for name, on in (("token budget", None), ("step budget", budget)):
            engine.scheduler.step_budget = on
            runs[name].append(
                measure(engine, args.streams, args.num_long, args.long_len, args.lead_steps, rng)
            )
    engine.scheduler.step_budget = budget
    return {name: summarize(r) for name, r in runs.items()}


def summarize(runs: list[GapRun]) -> dict[str, Any]:
    return {
        "max_gap_s": statistics.median(r.max_gap for r in runs),
        "median_gap_s": statistics.median(r.median_gap for r in runs),
        "ttft_s": statistics.median(statistics.mean(r.ttfts) for r in runs),
        "decode_step_s": statistics.median(r.decode_step for r in runs),
        "steps": statistics.median(r.steps for r in runs),
        "runs": [dataclasses.asdict(r) for r in runs],
    }


def run(args: argparse.Namespace) -> int:
    return run_at_log_level(args, _run)


def _run(args: argparse.Namespace) -> int:
    try:
        set_num_threads(args.num_threads)
        config = EngineConfig.from_cli_args(args)
        if args.long_len + 1 > (config.max_model_len or 0) or args.streams < 1 or args.num_long < 1:
            raise ValueError("--long-len must be below --max-model-len; --streams and --num-long at least 1.")
        engine = LLMEngine.from_config(config)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    try:
        budget = engine.scheduler.step_budget
        if budget is None:
            logger.error("The engine has no step-time target: give --max-step-time-ms above 0.")
            return 2
        target = budget.target_s
        result = compare(engine, args)
    finally:
        engine.shutdown()
    print(
        f"{args.streams} stream(s) decoding; {args.num_long} prompt(s) of {args.long_len} tokens arrive at once; "
        f"target {target * 1000:.0f} ms, max_num_batched_tokens {engine.scheduler.config.max_num_batched_tokens}; "
        f"medians of {args.repeats} run(s) each"
    )
    rows = [
        [
            name,
            s["max_gap_s"] * 1000,
            s["median_gap_s"] * 1000,
            s["ttft_s"],
            s["decode_step_s"] * 1000,
            s["steps"],
        ]
        for name, s in result.items()
    ]
    print(
        format_table(
            ["system", "longest gap ms", "median gap ms", "long TTFT s", "decode step ms", "steps"], rows
        )
    )
    if args.output_json:
        write_json(
            args.output_json,
            {
                "benchmark": "step-time",
                "date": now_iso(),
                "machine": machine_info(engine.device),
                "target_s": target,
                "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, type(None)))},
                "systems": result,
            },
        )
        print(f"\nWrote {args.output_json}")
    return 0
