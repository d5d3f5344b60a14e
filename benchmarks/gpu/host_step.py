#!/usr/bin/env python
"""Host work of a CUDA-graph decode step at 256 running requests, measured without a GPU.

The engine runs on the CPU with the default model and takes the GPU's decode path: a
``CUDAGraphRunner`` stages every decode step (block tables, slots, pending tokens) exactly as on a
GPU, but its replay, the device work, returns fixed hidden states and logits instead of running the
model. What is left is the host's work per step: scheduling, staging, the sampler's calls, token
bookkeeping, detokenization and stop checks. On the CPU the sampler's tensor work is real
computation over the whole vocabulary (device work on a GPU), so it is reported apart, and the
sampler's own host cost is measured on a vocabulary of 64.

Scheduling ahead (``async_scheduling``) is measured off and on, alternating; on a CPU both do the
same work, in another order. The figure to compare with a GPU's decode step is "host ms" (the step
less the sampler, whose tensor work runs on the device there).

    python benchmarks/gpu/host_step.py [--batch-size 256] [--steps 40]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # pagedllm_bench

import torch  # noqa: E402

from pagedllm import LLM, RequestOutputKind, SamplingParams  # noqa: E402
from pagedllm.engine.llm_engine import LLMEngine  # noqa: E402
from pagedllm.sample.sampler import Sampler, SamplingInputs  # noqa: E402
from pagedllm.worker.cuda_graphs import CUDAGraphRunner  # noqa: E402
from pagedllm_bench.common import write_json  # noqa: E402

PHASES = ("schedule", "prepare", "sample", "outputs")


def attach_stub_graphs(engine: LLMEngine, max_num_seqs: int, seed: int) -> None:
    """Decode steps take the CUDA-graph path, whose replay returns fixed outputs (no model run)."""
    runner = engine.runner
    assert runner.kv_cache is not None
    graphs = CUDAGraphRunner(
        runner.model,
        runner.kv_cache.layers,
        max_num_seqs=max_num_seqs,
        max_model_len=engine.max_model_len,
        block_size=engine.config.block_size,
        device=torch.device("cpu"),
    )
    graphs.capture()  # off CUDA: only the per-bucket metadata and launch configurations
    generator = torch.Generator().manual_seed(seed)
    graphs.logits.copy_(3 * torch.randn(graphs.logits.shape, generator=generator))
    hidden = torch.zeros(graphs.max_batch_size, engine.model_config.hidden_size)

    def replay(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return hidden[:batch_size], graphs.logits[:batch_size]

    graphs.replay = replay  # type: ignore[method-assign]
    runner.cuda_graphs = graphs


def measure(engine: LLMEngine, steps: int, blocks: int = 4) -> dict[str, dict[str, float]]:
    """Phase times per step with scheduling ahead off and on, alternating in ``blocks`` runs of
    ``steps // blocks`` steps each (outputs grow as the steps go, so neither mode gets the later ones)."""
    times = engine.step_times
    sums = {mode: {p: 0.0 for p in (*PHASES, "wall")} for mode in ("sync", "ahead")}
    counts = {"sync": 0, "ahead": 0}
    for _ in range(blocks):
        for mode in ("sync", "ahead"):
            engine.async_scheduling = mode == "ahead"
            engine.step()  # the first step in a new mode also resolves a step left in flight
            before = {p: getattr(times, p) for p in PHASES}
            launched = times.steps
            start = time.perf_counter()
            for _ in range(steps // blocks):
                engine.step()
            sums[mode]["wall"] += time.perf_counter() - start
            counts[mode] += times.steps - launched
            for p in PHASES:
                sums[mode][p] += getattr(times, p) - before[p]
    results = {}
    for mode, total in sums.items():
        n = counts[mode]
        r = {f"{p}_ms": 1e3 * total[p] / n for p in PHASES}
        r["step_ms"] = 1e3 * total["wall"] / n
        r["host_ms"] = r["step_ms"] - r["sample_ms"]
        results[mode] = r
    return results


def sampler_host_ms(batch_size: int, params: SamplingParams, repeats: int = 200) -> float:
    """The sampler on a vocabulary of 64: its tensor work is negligible, its host work is not."""
    batch = SamplingInputs(
        params=[params] * batch_size,
        prompt_token_ids=[[1] * 64] * batch_size,
        output_token_ids=[[2] * 64] * batch_size,
        generators=[None] * batch_size,
        bad_words_token_ids=[[]] * batch_size,
        eos_token_ids=[0],
    )
    logits = torch.randn(batch_size, 64)
    sampler = Sampler()
    timings = []
    for _ in range(repeats):
        t = time.perf_counter()
        sampler.sample(logits, batch).output()
        timings.append(time.perf_counter() - t)
    return 1e3 * statistics.median(timings)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    n = args.batch_size
    max_model_len = 1024
    llm = LLM(
        max_num_seqs=n,
        max_model_len=max_model_len,
        max_num_batched_tokens=max(4096, n * args.prompt_len),
        num_kv_blocks=n * (max_model_len // 16) + 16,
        enforce_eager=True,
    )
    engine = llm.llm_engine
    attach_stub_graphs(engine, n, args.seed)
    rng = random.Random(args.seed)
    results: dict[str, Any] = {"batch_size": n, "prompt_len": args.prompt_len, "steps": args.steps}
    for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        params = SamplingParams(
            temperature=1.0, max_tokens=max_model_len - args.prompt_len, ignore_eos=True, output_kind=kind
        )
        ids = [f"{kind.name}-{i}" for i in range(n)]
        for rid in ids:
            engine.add_request(
                rid, [rng.randrange(100, engine.vocab_size) for _ in range(args.prompt_len)], params
            )
        while engine.scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
        ):
            engine.step()
        for _ in range(3):
            engine.step()
        for mode, figures in measure(engine, args.steps).items():
            results[f"{kind.name.lower()}_{mode}"] = figures
        engine.abort_request(ids)
        engine.check_idle()
    sampler = sampler_host_ms(n, SamplingParams(temperature=1.0))
    results["sampler_host_ms_vocab64"] = sampler

    print(f"\nHost work of a decode step, {n} running requests, CUDA-graph staging, model not run")
    header = ("outputs", "mode", *[f"{p} ms" for p in PHASES], "step ms", "host ms (step - sample)")
    print(" | ".join(header))
    for kind in ("final_only", "cumulative", "delta"):
        for mode in ("sync", "ahead"):
            r = results[f"{kind}_{mode}"]
            cells = [
                kind,
                mode,
                *[f"{r[f'{p}_ms']:.2f}" for p in PHASES],
                f"{r['step_ms']:.2f}",
                f"{r['host_ms']:.2f}",
            ]
            print(" | ".join(cells))
    print(f"sampler host work (vocabulary of 64, temperature 1): {sampler:.2f} ms")
    if args.output_json:
        write_json(args.output_json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
