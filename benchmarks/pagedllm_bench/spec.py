"""``pagedllm bench spec``: speculative decoding (prompt lookup or a draft model) against plain decoding.

The workload is input-grounded, where prompt lookup pays: 16 chat requests (the model's chat
template) that ask the model to repeat a passage given in the message (12 passages of the shipped
``texts/us_constitution.txt``) or to copy a short piece of code (4 snippets), greedy, up to
``--output-len`` tokens, stopping at EOS. Two
engines are built in turn from the same arguments, one plain and one with ``--spec`` (the
``speculative_config`` JSON, default prompt lookup of up to 8 tokens after a 3- to 5-gram match; a
draft model with ``{"model": PATH, "num_speculative_tokens": k}``, which is checked to load before
the plain engine runs), and each runs, after an untimed warm-up request:

* batch 1: the 16 requests one at a time; decode tokens/s is the output tokens after the first over
  the time from each request's first token to its last, summed over the requests;
* ``--concurrency`` requests at once (default 8): the 16 requests in waves; output tokens/s over the
  elapsed time.

Reported: both engines' figures and their ratios (the batch-1 goal: at least 1.8), whether every
request produced the same tokens (greedy: it must), the acceptance rate (accepted over drafted
tokens) and the mean tokens a verifying request gets per step (1 + accepted drafts per draft).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import time
from pathlib import Path
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.engine_checks import check_speculative
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.draft_model import read_draft_config
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

logger = logging.getLogger("pagedllm_bench")

TEXT = Path(__file__).resolve().parent / "texts" / "us_constitution.txt"
DEFAULT_SPEC = (
    '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 5, "prompt_lookup_min": 3}'
)
GOAL = 1.8  # batch-1 decode tok/s with speculation over without

SNIPPETS = [
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
    "for i in range(1, 101):\n    if i % 15 == 0:\n        print('FizzBuzz')\n    elif i % 3 == 0:\n"
    "        print('Fizz')\n    elif i % 5 == 0:\n        print('Buzz')\n    else:\n        print(i)\n",
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fib(i) for i in range(10)])\n",
]


def grounded_requests() -> list[str]:
    """The 16 user messages: 12 passages to repeat, 4 snippets to copy."""
    paragraphs = [" ".join(p.split()) for p in TEXT.read_text().split("\n\n") if len(p.split()) >= 40]
    step = max(1, len(paragraphs) // 12)
    passages = [" ".join(p.split()[:90]) for p in paragraphs[::step][:12]]
    messages = [f"Repeat the following passage exactly.\n\nPassage:\n{p}" for p in passages]
    messages += [f"Copy the following code exactly.\n\nCode:\n{c}" for c in SNIPPETS]
    return messages


def grounded_prompts(engine: LLMEngine) -> list[str]:
    """The 16 requests as the model's chat template renders them (as a chat request would)."""
    return [engine.apply_chat_template([{"role": "user", "content": m}]) for m in grounded_requests()]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", default=DEFAULT_SPEC, help="speculative_config of the speculating engine.")
    parser.add_argument("--output-len", type=int, default=200, help="Most output tokens per request.")
    parser.add_argument("--concurrency", type=int, default=8, help="Requests at once in the second run.")
    add_run_args(parser, warmup=True)
    parser.set_defaults(max_model_len=1024)


@dataclasses.dataclass
class SystemRun:
    batch1_decode_tok_s: float
    concurrent_output_tok_s: float
    tokens: list[list[int]]
    stats: dict[str, int]


def _drain(engine: LLMEngine, first: dict[str, float], last: dict[str, float]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            now = time.perf_counter()
            first.setdefault(o.request_id, now)
            last[o.request_id] = now
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    return out


def run_system(config: EngineConfig, output_len: int, concurrency: int, warmup: bool) -> SystemRun:
    engine = LLMEngine.from_config(config)
    try:
        prompts = grounded_prompts(engine)
        params = SamplingParams(temperature=0, max_tokens=output_len)
        if warmup:
            engine.add_request("warmup", prompts[0][:200], SamplingParams(temperature=0, max_tokens=8))
            _drain(engine, {}, {})
        tokens: list[list[int]] = []
        decode_tokens, decode_time = 0, 0.0
        for i, prompt in enumerate(prompts):  # batch 1
            engine.reset_prefix_cache()
            first: dict[str, float] = {}
            last: dict[str, float] = {}
            engine.add_request(f"b{i}", prompt, params)
            out = _drain(engine, first, last)[f"b{i}"]
            tokens.append(out)
            decode_tokens += len(out) - 1
            decode_time += last[f"b{i}"] - first[f"b{i}"]
        engine.reset_prefix_cache()
        started = time.perf_counter()
        generated = 0
        for wave in range(0, len(prompts), concurrency):
            for i, prompt in enumerate(prompts[wave : wave + concurrency]):
                engine.add_request(f"c{wave + i}", prompt, params)
            generated += sum(len(t) for t in _drain(engine, {}, {}).values())
        elapsed = time.perf_counter() - started
        engine.check_idle()
        s = engine.get_stats()
        stats = {
            "drafts": s.spec_drafts,
            "draft_tokens": s.spec_draft_tokens,
            "accepted_tokens": s.spec_accepted_tokens,
        }
        return SystemRun(decode_tokens / decode_time, generated / elapsed, tokens, stats)
    finally:
        engine.shutdown()
        del engine
        gc.collect()


def run(args: argparse.Namespace) -> int:
    return run_at_log_level(args, _run)


def _run(args: argparse.Namespace) -> int:
    try:
        set_num_threads(args.num_threads)
        base = EngineConfig.from_cli_args(args, speculative_config=None)
        spec = dataclasses.replace(base, speculative_config=args.spec)
        parsed = check_speculative(spec, "generate")  # before the plain engine runs
        if parsed is not None and parsed.model is not None:
            read_draft_config(parsed.model)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    plain = run_system(base, args.output_len, args.concurrency, args.warmup)
    try:
        fast = run_system(spec, args.output_len, args.concurrency, args.warmup)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    prompts = plain.tokens
    same = sum(a == b for a, b in zip(plain.tokens, fast.tokens, strict=True))
    st = fast.stats
    acceptance = st["accepted_tokens"] / st["draft_tokens"] if st["draft_tokens"] else 0.0
    mean_length = 1 + st["accepted_tokens"] / st["drafts"] if st["drafts"] else 1.0
    batch1 = ratio(fast.batch1_decode_tok_s, plain.batch1_decode_tok_s)
    concurrent = ratio(fast.concurrent_output_tok_s, plain.concurrent_output_tok_s)
    print(
        f"Workload: {len(prompts)} input-grounded requests (12 passages to repeat, 4 snippets to copy), "
        f"greedy, up to {args.output_len} tokens; speculative_config {args.spec}"
    )
    rows: list[list[Any]] = [
        ["plain", plain.batch1_decode_tok_s, plain.concurrent_output_tok_s],
        ["speculative", fast.batch1_decode_tok_s, fast.concurrent_output_tok_s],
        ["ratio", batch1, concurrent],
    ]
    print(format_table(["system", "batch 1 decode tok/s", f"{args.concurrency} at once output tok/s"], rows))
    print(
        f"Acceptance rate: {acceptance:.3f} ({st['accepted_tokens']} of {st['draft_tokens']} draft tokens); "
        f"mean tokens per verifying step: {mean_length:.2f}"
    )
    print(f"Same greedy tokens: {same} of {len(prompts)} requests")
    print(f"batch-1 decode speed-up: {batch1:.2f}x (goal >= {GOAL})" if batch1 else "no figure")
    if args.output_json:
        result: dict[str, Any] = {
            "benchmark": "spec",
            "date": now_iso(),
            "machine": machine_info(),
            "speculative_config": args.spec,
            "systems": {
                name: {
                    "batch1_decode_tok_s": r.batch1_decode_tok_s,
                    "concurrent_output_tok_s": r.concurrent_output_tok_s,
                }
                for name, r in (("plain", plain), ("speculative", fast))
            },
            "concurrency": args.concurrency,
            "acceptance_rate": acceptance,
            "mean_accepted_length": mean_length,
            "spec_stats": st,
            "same_tokens": same,
            "ratios": {"batch1_decode": batch1, "concurrent_output": concurrent},
            "goals": {"batch1_decode_met": batch1 is not None and batch1 >= GOAL},
        }
        write_json(args.output_json, result)
        print(f"\nWrote {args.output_json}")
    return 0 if same == len(prompts) else 1
