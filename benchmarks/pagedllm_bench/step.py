"""``pagedllm bench step``: where the time of one decode step goes, at a fixed batch.

``--batch-size`` requests with random prompts of ``--context-len`` tokens are prefilled, then
``--steps`` decode-only steps are timed phase by phase with the engine's own step timers
(:class:`pagedllm.worker.phase_times.StepPhaseTimes`): scheduling, input preparation, the model forward
(LM head included), sampling, and output processing (token bookkeeping, stop checks,
detokenization, building outputs). Everything but the forward is the engine's per-step overhead.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import time
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm_bench.common import format_table, machine_info, now_iso, set_num_threads, write_json

logger = logging.getLogger(__name__)

PHASES = ("schedule", "prepare", "forward", "sample", "outputs", "record")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("step")
    group.add_argument("--batch-size", type=int, default=32, help="Running requests (default 32).")
    group.add_argument(
        "--context-len", type=int, default=256, help="Prompt tokens of each request (default 256)."
    )
    group.add_argument("--steps", type=int, default=32, help="Timed decode steps (default 32).")
    group.add_argument("--warmup-steps", type=int, default=4, help="Untimed decode steps first (default 4).")
    group.add_argument(
        "--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's default)."
    )
    group.add_argument("--output-json", default=None, help="Write the results to this JSON file.")
    engine_group = parser.add_argument_group("engine")
    EngineConfig.add_cli_args(engine_group)  # type: ignore[arg-type]


def measure_steps(
    engine: Any, batch_size: int, context_len: int, steps: int, warmup_steps: int, seed: int
) -> dict[str, Any]:
    """Prefill ``batch_size`` requests, then time ``steps`` decode steps of all of them."""
    from pagedllm.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=warmup_steps + steps + 1, ignore_eos=True)
    ids = [f"step-bench-{i}" for i in range(batch_size)]
    try:
        for rid in ids:
            prompt = [rng.randrange(100, engine.vocab_size) for _ in range(context_len)]
            engine.add_request(rid, prompt, params)
        while engine.scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
        ):
            engine.step()
        for _ in range(warmup_steps):
            engine.step()
        if engine.scheduler.num_running != batch_size:
            raise RuntimeError(
                f"only {engine.scheduler.num_running} of {batch_size} requests run together; "
                "raise --max-num-seqs or the KV cache size."
            )
        before = dataclasses.asdict(engine.step_times)
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
        after = dataclasses.asdict(engine.step_times)
    finally:
        engine.abort_request(ids)
    engine.check_idle()
    n = after["steps"] - before["steps"]
    per_step = {p: (after[p] - before[p]) / n for p in PHASES}
    step_s = wall / steps
    per_step["other"] = max(0.0, step_s - sum(per_step.values()))
    overhead = step_s - per_step["forward"]
    return {
        "batch_size": batch_size,
        "context_len": context_len,
        "steps": steps,
        "step_s": step_s,
        "phases_s": per_step,
        "overhead_s": overhead,
        "overhead_fraction": overhead / step_s,
        "tokens_per_s": batch_size / step_s,
    }


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        set_num_threads(args.num_threads)
        for flag in ("batch_size", "context_len", "steps"):
            if getattr(args, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be at least 1.")
        if args.warmup_steps < 0:
            raise ValueError("--warmup-steps must not be negative.")
        config = EngineConfig.from_cli_args(args)
        if args.max_num_seqs < args.batch_size:
            config = dataclasses.replace(config, max_num_seqs=args.batch_size)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    from pagedllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(config)
    result = measure_steps(
        engine, args.batch_size, args.context_len, args.steps, args.warmup_steps, args.seed
    )
    result.update(date=now_iso(), machine=machine_info(), engine_config=dataclasses.asdict(config))
    step_ms = result["step_s"] * 1e3
    rows = [[p, f"{s * 1e3:.2f}", f"{s * 1e3 / step_ms:.1%}"] for p, s in result["phases_s"].items()]
    rows.append(["step", f"{step_ms:.2f}", "100.0%"])
    print(
        f"\nDecode step at {args.batch_size} running requests, context {args.context_len}+ tokens, "
        f"{args.steps} steps ({result['tokens_per_s']:.1f} output tok/s):\n"
    )
    print(format_table(["phase", "ms/step", "share"], rows))
    print(
        f"\nOverhead outside the model forward: {result['overhead_s'] * 1e3:.2f} ms/step = "
        f"{result['overhead_fraction']:.1%} of the step."
    )
    if args.output_json:
        write_json(args.output_json, result)
        print(f"\nWrote {args.output_json}")
    return 0
