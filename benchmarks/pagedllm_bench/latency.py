"""``pagedllm bench latency``: batch-1 prompt processing and decoding speed, optionally against llama.cpp.

One request at a time: a prompt of ``--input-len`` random token ids (EOS and BOS excluded, seeded by
``--seed``; the same prompt for every run and system) generating ``--output-len`` tokens greedily with
EOS ignored. Two figures per run:

* prompt processing tokens/s: ``input_len`` over the time from submitting the prompt to its first
  token (the engine: ``add_request`` to the ``step`` that returns the first token; llama.cpp: the
  ``llama_decode`` of the whole prompt and the argmax of its last logits);
* decode tokens/s: the ``output_len - 1`` tokens after the first over the time from the first token
  to the last.

Each system runs ``--repeats`` times (default 3) after an untimed warm-up request and reports the
median of each figure (and how many leading greedy tokens the two systems' outputs share, a check that
they run the same model, and the CPU cores the process used over the timed runs: well below the thread
count means other processes took the cores, and the figures are not to be trusted on a shared machine). The engine's prefix cache is emptied before every run, so no run reuses the
previous one's prompt. With ``--baseline llama.cpp`` the native ``llama-bench`` measures ``-p input_len`` and
``-n output_len`` on the same file and threads (:func:`native_latency`). With ``--baseline
llama.cpp-python`` llama.cpp (through its Python binding) runs the same prompt on the engine's
GGUF file (the default model unless ``--model`` names another) in the same process, after the engine,
with the same thread count (``--threads``, else torch's default), and the ratios engine / llama.cpp
are reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import statistics
import time
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm_bench import llamacpp
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
from pagedllm_bench.llamacpp import LatencySample
from pagedllm_bench.workloads import random_workload

logger = logging.getLogger("pagedllm_bench")


def engine_latency(engine: LLMEngine, prompt: list[int], output_len: int, request_id: str) -> LatencySample:
    """One timed batch-1 request through the engine (prefix cache emptied first)."""
    engine.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    first: float | None = None
    last: float | None = None
    tokens: list[int] = []
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    try:
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                if out.request_id != request_id:
                    continue
                if first is None and out.outputs and out.outputs[0].token_ids:
                    first = now
                if out.finished:
                    last = now
                    tokens = list(out.outputs[0].token_ids)
    except BaseException:
        engine.abort_request(request_id)
        raise
    if first is None or last is None:
        raise RuntimeError(f"request {request_id} finished without output.")
    if len(tokens) != output_len:
        raise RuntimeError(f"request {request_id} produced {len(tokens)} tokens instead of {output_len}.")
    return LatencySample(len(prompt), first - start, last - first, tokens)


class CpuUse:
    """CPU seconds of this process (all its threads) per wall-clock second since construction: close to
    the thread count while the threads had the cores to themselves, lower when other processes took
    CPU time from them (their figures then understate the system's speed)."""

    def __init__(self) -> None:
        self.cpu = time.process_time()
        self.wall = time.perf_counter()

    def cores(self) -> float:
        return (time.process_time() - self.cpu) / max(time.perf_counter() - self.wall, 1e-9)


def summarize(samples: list[LatencySample], cpu_use: float | None = None) -> dict[str, Any]:
    """Median (and every run's) prompt and decode speeds of a system's runs."""
    prompt = [s.prompt_tokens_per_s for s in samples]
    decode = [s.decode_tokens_per_s for s in samples]
    return {
        "prompt_tokens_per_s": statistics.median(prompt),
        "cpu_cores_used": cpu_use,
        "decode_tokens_per_s": statistics.median(decode),
        "ttft_s": statistics.median(s.prompt_s for s in samples),
        "output_tokens": samples[0].output_tokens,
        "decode_s_per_token": statistics.median(
            s.decode_s / max(len(s.output_tokens) - 1, 1) for s in samples
        ),
        "runs": [
            {
                "prompt_s": s.prompt_s,
                "decode_s": s.decode_s,
                "prompt_tokens_per_s": s.prompt_tokens_per_s,
                "decode_tokens_per_s": s.decode_tokens_per_s,
            }
            for s in samples
        ],
    }


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("latency")
    group.add_argument(
        "--input-len", type=int, default=512, help="Prompt tokens, timed to the first token (default 512)."
    )
    group.add_argument(
        "--output-len",
        type=int,
        default=128,
        help="Generated tokens, EOS ignored; decoding is timed from the first to the last (default 128).",
    )
    group.add_argument(
        "--repeats", type=int, default=3, help="Timed runs per system; the median is reported."
    )
    group.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Run a short untimed request first on each system (default on).",
    )
    group.add_argument(
        "--baseline",
        default=None,
        choices=[llamacpp.NAME, llamacpp.NATIVE_NAME],
        help="Also measure llama.cpp on the same GGUF file and threads: llama.cpp runs the native llama-bench "
        "(-p INPUT_LEN, -n OUTPUT_LEN; built once into the cache), llama.cpp-python the same prompt in this "
        "process through the Python binding (needs the llamacpp extra).",
    )
    add_run_args(parser, llama_cpp_threads=True)


def run(args: argparse.Namespace) -> int:
    return run_at_log_level(args, _run)


def _run(args: argparse.Namespace) -> int:
    try:
        set_num_threads(args.num_threads)
        for name in ("input_len", "output_len", "repeats"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}.")
        config = EngineConfig.from_cli_args(args)
        native = args.baseline == llamacpp.NATIVE_NAME
        if native:
            gguf: str | None = llamacpp.gguf_path(config.model, llamacpp.NATIVE_NAME)
        else:
            gguf = llamacpp.check_baseline(config.model) if args.baseline else None
    except (ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 2
    llamacpp.set_log_level(args.log_level)
    threads = torch.get_num_threads()
    engine = LLMEngine.from_config(config)
    if args.input_len + args.output_len > engine.max_model_len:
        logger.error(
            "--input-len + --output-len = %d exceeds max_model_len=%d.",
            args.input_len + args.output_len,
            engine.max_model_len,
        )
        return 2
    exclude = set(engine.eos_token_ids)
    if engine.model_config.bos_token_id is not None:
        exclude.add(engine.model_config.bos_token_id)
    workload = random_workload(
        1, (args.input_len,) * 2, (args.output_len,) * 2, engine.vocab_size, config.seed, exclude
    )
    prompt = workload.requests[0].prompt_token_ids
    warm_prompt = prompt[:16]

    if args.warmup:
        engine_latency(engine, warm_prompt, 4, "latency-warmup")
    cpu = CpuUse()
    engine_samples = [
        engine_latency(engine, prompt, args.output_len, f"latency-{i}") for i in range(args.repeats)
    ]
    systems: dict[str, dict[str, Any]] = {"pagedllm": summarize(engine_samples, cpu.cores())}
    model_name = engine.model_name
    engine_config = dataclasses.asdict(engine.config)
    device = str(engine.device)
    engine_dtype = str(engine.executor.dtype).removeprefix("torch.")
    del engine
    gc.collect()

    system_info = None
    if gguf is not None and native:
        try:
            systems[llamacpp.NATIVE_NAME] = native_latency(gguf, threads, args)
        except RuntimeError as exc:
            logger.error("Baseline %s failed: %s", llamacpp.NATIVE_NAME, exc)
            systems[llamacpp.NATIVE_NAME] = {"error": str(exc)}
    elif gguf is not None:
        try:
            with llamacpp.LlamaCppModel(gguf, threads) as model:
                system_info = model.system_info()
                with llamacpp.latency_context(model, args.input_len, args.output_len) as ctx:
                    if args.warmup:
                        llamacpp.measure_latency(ctx, warm_prompt, 4)
                    cpu = CpuUse()
                    llama_samples = [
                        llamacpp.measure_latency(ctx, prompt, args.output_len) for _ in range(args.repeats)
                    ]
                    cores = cpu.cores()
            systems[llamacpp.NAME] = summarize(llama_samples, cores)
        except (RuntimeError, ValueError, MemoryError) as exc:
            logger.error("Baseline %s failed: %s", llamacpp.NAME, exc)
            systems[llamacpp.NAME] = {"error": str(exc)}

    ratios = _ratios(systems)
    _print_report(systems, ratios, args, threads)
    if args.output_json:
        write_json(
            args.output_json,
            {
                "benchmark": "latency",
                "date": now_iso(),
                "model": model_name,
                "gguf": gguf,
                "machine": machine_info(),
                "llama_cpp_system_info": system_info,
                "peak_rss_mib": peak_rss_mib(),
                "device": device,
                "threads": threads,
                "input_len": args.input_len,
                "output_len": args.output_len,
                "repeats": args.repeats,
                "warmup": args.warmup,
                "engine_config": engine_config,
                "engine_dtype": engine_dtype,
                "systems": systems,
                "ratios": ratios,
            },
        )
        print(f"\nWrote {args.output_json}")
    return 0


def native_latency(path: str, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    """``--baseline llama.cpp``: the native ``llama-bench`` (built once) on the same file and threads,
    ``-p input_len`` and ``-n output_len`` (its generation starts from an empty context, not after the
    prompt), each at its best over llama.cpp's runtime variants; the mean of ``--repeats`` runs."""
    from pagedllm_bench.native import ensure_tools
    from pagedllm_bench.native_run import best_with_fallback, llama_bench

    tools = ensure_tools()

    def best(**test: int) -> dict[str, Any]:
        return best_with_fallback(
            lambda v: llama_bench(tools, path, threads, repetitions=args.repeats, variant=v, **test),
            "tokens_per_s",
        )

    pp = best(n_prompt=args.input_len)
    tg = best(n_gen=args.output_len)
    return {
        "prompt_tokens_per_s": pp["tokens_per_s"],
        "ttft_s": args.input_len / pp["tokens_per_s"],
        "decode_tokens_per_s": tg["tokens_per_s"],
        "decode_s_per_token": 1 / tg["tokens_per_s"],
        "cpu_cores_used": None,
        "output_tokens": [],
        "llama_bench": {"prompt": pp, "decode": tg},
    }


def _ratios(systems: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    base = systems.get(llamacpp.NAME) or systems.get(llamacpp.NATIVE_NAME)
    if base is None or "error" in base:
        return None
    ours = systems["pagedllm"]
    return {
        "prompt_tokens_per_s": ratio(ours["prompt_tokens_per_s"], base["prompt_tokens_per_s"]),
        "decode_tokens_per_s": ratio(ours["decode_tokens_per_s"], base["decode_tokens_per_s"]),
        # The native tool generates random tokens: no outputs to compare.
        "greedy_tokens_agreeing": (
            common_prefix(ours["output_tokens"], base["output_tokens"]) if base["output_tokens"] else None
        ),
    }


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two outputs share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _print_report(
    systems: dict[str, dict[str, Any]], ratios: dict[str, Any] | None, args: argparse.Namespace, threads: int
) -> None:
    print(
        f"Batch 1, prompt {args.input_len} tokens, {args.output_len} generated, {threads} threads, "
        f"median of {args.repeats}"
    )
    rows = []
    for name, m in systems.items():
        if "error" in m:
            rows.append([f"{name} (failed)", None, None, None, None, None])
            continue
        rows.append(
            [
                name,
                m["prompt_tokens_per_s"],
                m["ttft_s"] * 1e3,
                m["decode_tokens_per_s"],
                m["decode_s_per_token"] * 1e3,
                m["cpu_cores_used"],
            ]
        )
    print()
    print(format_table(["system", "prompt tok/s", "TTFT ms", "decode tok/s", "ms/token", "CPU cores"], rows))
    for name, m in systems.items():
        if "error" in m:
            print(f"\n{name} failed: {m['error']}")
    if ratios is not None:
        print(
            "\npagedllm / llama.cpp: prompt processing "
            + _x(ratios["prompt_tokens_per_s"])
            + ", decoding "
            + _x(ratios["decode_tokens_per_s"])
        )
        if ratios["greedy_tokens_agreeing"] is not None:
            print(
                f"Greedy outputs agree on their first {ratios['greedy_tokens_agreeing']} of "
                f"{args.output_len} tokens."
            )


def _x(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "n/a"
