"""The pagedllm side of ``pagedllm bench scale``, run in a process of its own.

``python -m pagedllm_bench.scale_engine --model FILE --threads T --output-json OUT [...]`` loads the
engine once and measures, in this order (every phase after an untimed warm-up request):

* ``load``: seconds to build the engine (model read, weights prepared, KV cache allocated) and the
  resident memory it added (``VmRSS`` after minus before, with its anonymous and file-backed parts);
  the KV pool holds just the batch phase's sequences at full length; then the memory added once a
  first request has read every weight, with and without the KV pool (``rss_kv_apart_mib``);
* ``decode``: batch-1 decode tokens/s, ``--decode-tokens`` tokens generated one per step after a
  one-token prompt (llama-bench's ``tg`` test: generation from an empty context), median of
  ``--repeats``;
* ``prompt``: a ``--prompt-tokens`` prompt over the time to its first token (llama-bench's ``pp``),
  median of ``--repeats``;
* ``batch``: ``--batch-sequences`` requests of ``--batch-prompt`` random prompt tokens and
  ``--batch-output`` output tokens (EOS ignored) submitted together, end to end, as
  ``llama-batched-bench`` runs them;
* ``busy``: the ``decode`` figure again while :func:`busy_neighbour` spins on one core.

Prompts are random token ids (seeded), greedy decoding, the prefix cache emptied before each request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

PHASES = ("load", "decode", "prompt", "batch", "busy")
# The untimed warm-up request before the phases: prompt tokens, tokens generated.
WARMUP_PROMPT, WARMUP_TOKENS = 16, 4


def memory_status() -> dict[str, float]:
    """This process's resident memory in MiB: ``VmRSS`` and its ``RssAnon``/``RssFile`` parts."""
    out: dict[str, float] = {}
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) / 1024
    return out


@contextmanager
def busy_neighbour() -> Iterator[subprocess.Popen[bytes]]:
    """A process spinning on one core (``while True: pass``) for the duration; stopped and reaped on
    exit (killed when it does not end within 10 s of being asked)."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _batch(engine: Any, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """Every prompt submitted at once, stepped to the end; wall time and tokens."""
    from pagedllm.sampling_params import SamplingParams

    engine.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"scale-batch-{i}", p, params)
    produced = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                produced += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    total = sum(len(p) for p in prompts) + produced
    return {
        "sequences": len(prompts),
        "prompt_len": len(prompts[0]),
        "output_len": output_len,
        "elapsed_s": elapsed,
        "output_tokens": produced,
        "total_tokens_per_s": total / elapsed,
        "output_tokens_per_s": produced / elapsed,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the phases of ``args.phases`` (see the module docstring); their results by phase."""
    import torch

    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm_bench.latency import engine_latency
    from pagedllm_bench.workloads import random_workload

    torch.set_num_threads(args.threads)
    phases = set(args.phases.split(","))
    batch = "batch" in phases
    longest = max(
        WARMUP_PROMPT + WARMUP_TOKENS,
        args.decode_tokens + 2,
        args.prompt_tokens + 2,
        args.batch_prompt + args.batch_output if batch else 0,
    )
    # A KV pool just large enough for the phases (the batch's sequences at full length, one block of
    # slack each; one sequence without the batch phase), so that neither the memory nor the time of
    # loading is a default-sized pool's.
    block = 16
    seqs = max(args.batch_sequences, 1) if batch else 1
    per_seq = -(-longest // block) + 1
    config = EngineConfig(
        model=args.model,
        max_model_len=longest,
        max_num_seqs=seqs,
        block_size=block,
        num_kv_blocks=seqs * per_seq,
        seed=0,
    )
    before = memory_status()
    start = time.perf_counter()
    engine = LLMEngine.from_config(config)
    load_s = time.perf_counter() - start
    after = memory_status()
    result: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "config": {"max_model_len": longest, "num_kv_blocks": config.num_kv_blocks, "block_size": block},
    }
    result["load"] = {
        "load_s": load_s,
        "rss_added_mib": after["VmRSS"] - before["VmRSS"],
        "rss_anon_added_mib": after.get("RssAnon", 0.0) - before.get("RssAnon", 0.0),
        "rss_file_added_mib": after.get("RssFile", 0.0) - before.get("RssFile", 0.0),
        "rss_mib": after["VmRSS"],
    }
    exclude = set(engine.eos_token_ids)
    if engine.model_config.bos_token_id is not None:
        exclude.add(engine.model_config.bos_token_id)

    def prompt_of(n: int, seed: int) -> list[int]:
        return (
            random_workload(1, (n, n), (1, 1), engine.vocab_size, seed, exclude).requests[0].prompt_token_ids
        )

    engine_latency(engine, prompt_of(WARMUP_PROMPT, 99), WARMUP_TOKENS, "scale-warmup")
    # After a first request every weight has been read (mapped file pages count once touched), as in
    # llama-server's figure, taken after its warm-up decode. The KV pool is set apart: its size is
    # this benchmark's choice (float32, the batch phase's sequences at full length).
    warm = memory_status()
    kv_mib = engine.executor.kv_cache_bytes / 2**20
    result["load"].update(
        {
            "kv_pool_mib": kv_mib,
            "rss_after_first_request_mib": warm["VmRSS"] - before["VmRSS"],
            "rss_kv_apart_mib": warm["VmRSS"] - before["VmRSS"] - kv_mib,
            "rss_file_after_first_request_mib": warm.get("RssFile", 0.0) - before.get("RssFile", 0.0),
        }
    )

    def decode() -> dict[str, Any]:
        runs = [
            engine_latency(engine, prompt_of(1, i), args.decode_tokens + 1, f"scale-decode-{i}")
            for i in range(args.repeats)
        ]
        rates = [args.decode_tokens / r.decode_s for r in runs]
        return {"tokens_per_s": statistics.median(rates), "samples_tokens_per_s": rates}

    if "decode" in phases:
        result["decode"] = decode()
    if "prompt" in phases:
        runs = [
            engine_latency(engine, prompt_of(args.prompt_tokens, 10 + i), 1, f"scale-prompt-{i}")
            for i in range(args.repeats)
        ]
        rates = [args.prompt_tokens / r.prompt_s for r in runs]
        result["prompt"] = {"tokens_per_s": statistics.median(rates), "samples_tokens_per_s": rates}
    if "batch" in phases:
        prompts = random_workload(
            args.batch_sequences,
            (args.batch_prompt,) * 2,
            (args.batch_output,) * 2,
            engine.vocab_size,
            1234,
            exclude,
        )
        _batch(engine, [r.prompt_token_ids[:8] for r in prompts.requests[:2]], 2)  # warm-up
        result["batch"] = _batch(engine, [r.prompt_token_ids for r in prompts.requests], args.batch_output)
    if "busy" in phases:
        with busy_neighbour():
            result["busy"] = decode()
    result["peak_rss_mib"] = memory_status()["VmRSS"]
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--batch-sequences", type=int, default=32)
    p.add_argument("--batch-prompt", type=int, default=128)
    p.add_argument("--batch-output", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output-json", required=True)
    args = p.parse_args(argv)
    unknown = set(args.phases.split(",")) - set(PHASES)
    if unknown:
        p.error(f"--phases: unknown {', '.join(sorted(unknown))}; choose from {', '.join(PHASES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = measure(args)
    with open(args.output_json, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
