"""``pagedllm bench throughput``: offline throughput of the engine, optionally against HF baselines.

All requests are queued at once and the engine is stepped until every one has finished; the timed
region starts before the first ``add_request`` and ends when the last request finishes (model loading,
KV cache allocation and a short warm-up request are outside it, for the engine and the baselines
alike). With baselines the engine runs again after them (``--engine-after-baselines``, on by
default) and the mean of its two times is compared with theirs: the baselines take minutes, over
which a shared machine's speed can drift. ``--baseline llama.cpp-python`` decodes the same workload
with llama.cpp, through its Python binding, on the engine's GGUF file (:mod:`pagedllm_bench.llamacpp`: greedy, with the engine's
``max_num_seqs``, ``max_num_batched_tokens`` and threads). Sampling is greedy unless ``--temperature``
is set; EOS is ignored (``--no-ignore-eos`` to honour it) so every request produces exactly its
output length.

Reported: requests/s, output tokens/s, total (prompt + output) tokens/s, the ratio of the engine's
figures to each baseline's, per-request TTFT and end-to-end latency, engine statistics (preemptions,
prefix cache hit rate, peak KV cache usage, peak RSS) and the KV cache waste, i.e. slots allocated to
running requests but not holding a token (``blocks held * block_size - tokens held``), sampled after
every engine step.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm_bench import baselines as baselines_module
from pagedllm_bench import llamacpp
from pagedllm_bench.common import (
    add_run_args,
    distribution,
    format_table,
    machine_info,
    now_iso,
    peak_rss_mib,
    ratio,
    run_at_log_level,
    set_num_threads,
    write_json,
)
from pagedllm_bench.roofline import load_roofline, measure_roofline, workload_floor
from pagedllm_bench.workloads import BenchRequest, Workload, add_workload_args, build_workload

logger = logging.getLogger("pagedllm_bench")


@dataclass
class KVWasteSampler:
    """Accumulates KV cache waste of running requests, sampled after engine steps.

    Waste of one request is ``len(block_ids) * block_size - num_computed_tokens``: slots its blocks
    hold that no token fills. For contrast, ``reserved_waste`` is what reserving each request's whole
    length (prompt + max tokens) up front, as a contiguous per-sequence cache does, would leave unused
    at the same moment.
    """

    block_size: int
    samples: int = 0  # (step, running request) pairs
    steps: int = 0
    waste_sum: int = 0
    waste_max: int = 0
    reserved_waste_sum: int = 0
    slots_held_sum: int = 0
    peak_running: int = 0
    peak_kv_usage: float = 0.0

    def sample(self, engine: LLMEngine) -> None:
        running = engine.scheduler.running
        self.steps += 1
        self.peak_running = max(self.peak_running, len(running))
        self.peak_kv_usage = max(self.peak_kv_usage, engine.kv_cache_manager.usage())
        for req in running:
            held = len(req.block_ids) * self.block_size
            waste = held - req.num_computed_tokens
            self.samples += 1
            self.waste_sum += waste
            self.waste_max = max(self.waste_max, waste)
            self.slots_held_sum += held
            self.reserved_waste_sum += req.num_prompt_tokens + req.max_tokens - req.num_computed_tokens

    def as_dict(self) -> dict[str, Any]:
        n = max(self.samples, 1)
        return {
            "block_size": self.block_size,
            "steps_sampled": self.steps,
            "waste_slots_mean_per_running_request": self.waste_sum / n,
            "waste_slots_max_per_running_request": self.waste_max,
            "waste_fraction_of_held_slots": self.waste_sum / max(self.slots_held_sum, 1),
            "reserved_waste_slots_mean_per_running_request": self.reserved_waste_sum / n,
            "peak_running_requests": self.peak_running,
            "peak_kv_cache_usage": self.peak_kv_usage,
        }


@dataclass
class EngineRun:
    """One timed engine run of a workload."""

    elapsed_s: float
    outputs: list[RequestOutput]
    stats_delta: dict[str, float]
    kv_waste: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)

    def metrics(self, workload: Workload) -> dict[str, Any]:
        elapsed = max(self.elapsed_s, 1e-9)
        n_prompt = sum(len(o.prompt_token_ids) for o in self.outputs)
        n_out = sum(len(c.token_ids) for o in self.outputs for c in o.outputs)
        ttft = []
        e2e = []
        for o in self.outputs:
            m = o.metrics
            if m is None:
                continue
            if m.first_token_time is not None:
                ttft.append(m.first_token_time - m.arrival_time)
            if m.finished_time is not None:
                e2e.append(m.finished_time - m.arrival_time)
        queries = self.stats_delta["prefix_cache_queries"]
        return {
            "name": "pagedllm",
            "elapsed_s": self.elapsed_s,
            "num_requests": len(self.outputs),
            "prompt_tokens": n_prompt,
            "output_tokens": n_out,
            "requested_output_tokens": workload.num_output_tokens,
            "requests_per_s": len(self.outputs) / elapsed,
            "output_tokens_per_s": n_out / elapsed,
            "total_tokens_per_s": (n_prompt + n_out) / elapsed,
            "ttft_s": distribution(ttft),
            "e2e_latency_s": distribution(e2e),
            "num_preemptions": int(self.stats_delta["num_preemptions"]),
            "prefix_cache_queries": int(queries),
            "prefix_cache_hits": int(self.stats_delta["prefix_cache_hits"]),
            "prefix_cache_hit_rate": self.stats_delta["prefix_cache_hits"] / queries if queries else 0.0,
            "prompt_tokens_computed": int(self.stats_delta["prompt_tokens_computed"]),
            "kv_cache": self.kv_waste,
            "engine_config": self.config,
        }


def with_mean_time(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """``first``'s metrics with its time and rates replaced by those of the mean time of both runs.

    Latency distributions and engine statistics stay the first run's; ``runs`` lists each run's time
    and rates.
    """
    keys = ("elapsed_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s")
    runs = [{k: m[k] for k in keys} for m in (first, second)]
    elapsed = (first["elapsed_s"] + second["elapsed_s"]) / 2
    counts = {
        "requests_per_s": first["num_requests"],
        "output_tokens_per_s": first["output_tokens"],
        "total_tokens_per_s": first["prompt_tokens"] + first["output_tokens"],
    }
    merged = {**first, "elapsed_s": elapsed, "runs": runs}
    merged.update({k: n / max(elapsed, 1e-9) for k, n in counts.items()})
    return merged


def _params(req: BenchRequest, temperature: float, ignore_eos: bool) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=req.output_len, ignore_eos=ignore_eos)


def _run_untimed(engine: LLMEngine, request_id: str, req: BenchRequest) -> None:
    engine.add_request(request_id, req.prompt_token_ids, _params(req, 0.0, True))
    while engine.has_unfinished_requests():
        engine.step()


def run_engine(
    engine: LLMEngine,
    workload: Workload,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    warmup: bool = True,
    prime_prefix_cache: bool = False,
) -> EngineRun:
    """Queue every request of ``workload`` at once and step ``engine`` until all have finished.

    ``warmup`` first runs a short unrelated request (then empties the prefix cache);
    ``prime_prefix_cache`` runs the first request's prompt once, untimed, so that a shared prefix is
    already cached when the timed run starts (the steady state of a server whose requests share a
    system prompt).
    """
    if warmup:
        vocab = engine.vocab_size
        _run_untimed(engine, "bench-warmup", BenchRequest([(7 * i + 11) % vocab for i in range(16)], 4))
        engine.reset_prefix_cache()
    if prime_prefix_cache and workload.requests:
        _run_untimed(engine, "bench-prime", BenchRequest(workload.requests[0].prompt_token_ids, 1))
    before = dataclasses.asdict(engine.get_stats())
    sampler = KVWasteSampler(engine.config.block_size)
    ids = [f"bench-{i}" for i in range(len(workload.requests))]
    finished: dict[str, RequestOutput] = {}
    start = time.perf_counter()
    arrival = time.monotonic()
    try:
        for rid, req in zip(ids, workload.requests, strict=True):
            engine.add_request(rid, req.prompt_token_ids, _params(req, temperature, ignore_eos), arrival)
        while len(finished) < len(ids):
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            sampler.sample(engine)
            if len(finished) < len(ids) and not engine.has_unfinished_requests():
                raise RuntimeError("the engine went idle with requests unfinished.")
    except BaseException:
        engine.abort_request([i for i in ids if i not in finished])
        raise
    elapsed = time.perf_counter() - start
    after = dataclasses.asdict(engine.get_stats())
    counters = ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens_computed")
    delta = {k: float(after[k] - before[k]) for k in counters}
    config = dataclasses.asdict(engine.config)
    config.update(
        resolved_max_model_len=engine.max_model_len,
        resolved_num_kv_blocks=engine.kv_cache_manager.pool.num_blocks,
        resolved_max_num_batched_tokens=engine.scheduler.config.max_num_batched_tokens,
        device=str(engine.device),
    )
    return EngineRun(elapsed, [finished[i] for i in ids], delta, sampler.as_dict(), config)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, prefix=True, dataset=True)
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--temperature", type=float, default=0.0, help="Sampling temperature (default 0: greedy)."
    )
    group.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Generate exactly each request's output length (default on).",
    )
    group = parser.add_argument_group("comparisons")
    group.add_argument(
        "--baseline",
        default=None,
        metavar="NAMES",
        help="Comma-separated baselines to run on the same workload: hf-static, hf-cb (HF transformers), "
        "llama.cpp-python (llama.cpp through its Python binding, the same GGUF file; needs the llamacpp "
        "extra). The native llama.cpp tools are compared by 'pagedllm bench scale'.",
    )
    group.add_argument(
        "--baseline-batch-size", type=int, default=16, help="Batch size of hf-static (default 16)."
    )
    group.add_argument(
        "--hf-cb-max-batch-tokens",
        type=int,
        default=None,
        help="Tokens per forward pass of hf-cb (default: the engine's max_num_batched_tokens).",
    )
    group.add_argument(
        "--engine-after-baselines",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="With --baseline, run the engine again after the baselines and compare the mean of its two "
        "times with theirs, so that a drift of the machine's speed during the long run weighs on both "
        "sides (default on).",
    )
    group.add_argument(
        "--compare-prefix-caching",
        action="store_true",
        help="Run the workload twice, with prefix caching on and off, and report the TTFT p50 ratio.",
    )
    group.add_argument(
        "--prime-prefix-cache",
        action="store_true",
        help="Run the first prompt once, untimed, before the timed run so a shared prefix starts cached.",
    )
    group.add_argument(
        "--roofline-json",
        default=None,
        help="A 'pagedllm bench roofline --output-json' file: report throughput as a fraction of its floors.",
    )
    group.add_argument(
        "--measure-roofline",
        action="store_true",
        help="Measure the roofline (as 'pagedllm bench roofline' does) in this run, just before the "
        "engine's timed run, and report throughput as a fraction of it: on a shared machine whose speed "
        "drifts, the two measurements then see the same conditions.",
    )
    add_run_args(parser, warmup=True)


def _engine_summary(metrics: dict[str, Any]) -> str:
    kv = metrics["kv_cache"]
    return (
        f"preemptions {metrics['num_preemptions']}, prefix cache hit rate "
        f"{metrics['prefix_cache_hit_rate']:.1%}, peak KV usage {kv['peak_kv_cache_usage']:.1%}, "
        f"KV waste per running request mean {kv['waste_slots_mean_per_running_request']:.1f} / max "
        f"{kv['waste_slots_max_per_running_request']} slots "
        f"({kv['waste_fraction_of_held_slots']:.1%} of held slots; reserving whole requests: "
        f"{kv['reserved_waste_slots_mean_per_running_request']:.1f})"
    )


def run(args: argparse.Namespace) -> int:
    return run_at_log_level(args, _run)


def _run(args: argparse.Namespace) -> int:
    try:
        set_num_threads(args.num_threads)
        hf_baselines, use_llama_cpp = llamacpp.split_baselines(args.baseline)
        baseline_names = baselines_module.parse_baselines(hf_baselines)
        if args.temperature < 0:
            raise ValueError(f"--temperature must be non-negative, got {args.temperature}.")
        config = EngineConfig.from_cli_args(args)
        gguf = llamacpp.check_baseline(config.model, args.temperature) if use_llama_cpp else None
        if args.roofline_json and args.measure_roofline:
            raise ValueError("give --roofline-json or --measure-roofline, not both.")
        roofline = load_roofline(args.roofline_json) if args.roofline_json else None
    except (ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 2

    engine = LLMEngine.from_config(config)
    try:
        exclude = set(engine.eos_token_ids)
        if engine.model_config.bos_token_id is not None:
            exclude.add(engine.model_config.bos_token_id)
        workload = build_workload(args, engine.vocab_size, engine.tokenizer, exclude)
        too_long = [
            i for i, r in enumerate(workload.requests) if r.prompt_len + r.output_len > engine.max_model_len
        ]
        if too_long:
            raise ValueError(
                f"{len(too_long)} requests need more than max_model_len={engine.max_model_len} tokens "
                f"(the first: request {too_long[0]})."
            )
    except (ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 2
    print(
        f"Workload {workload.name}: {len(workload.requests)} requests, {workload.num_prompt_tokens} prompt "
        f"tokens, {workload.num_output_tokens} output tokens"
    )
    model_name = engine.model_name
    eos_ids = list(engine.eos_token_ids)
    if args.measure_roofline:
        dtype_name = str(engine.runner.dtype).removeprefix("torch.")
        roofline = measure_roofline(engine.model_config, model_name, dtype_name)
        roofline["machine"] = machine_info()
    main_run = run_engine(
        engine, workload, args.temperature, args.ignore_eos, args.warmup, args.prime_prefix_cache
    )
    systems: dict[str, dict[str, Any]] = {"pagedllm": main_run.metrics(workload)}
    max_num_seqs = engine.config.max_num_seqs
    max_batched = engine.scheduler.config.max_num_batched_tokens
    engine_device = str(engine.device)
    rerun = bool(baseline_names or gguf) and args.engine_after_baselines
    if not rerun:
        del engine
        gc.collect()

    prefix_comparison: dict[str, Any] | None = None
    if args.compare_prefix_caching:
        other = not config.enable_prefix_caching
        other_engine = LLMEngine.from_config(dataclasses.replace(config, enable_prefix_caching=other))
        other_run = run_engine(
            other_engine, workload, args.temperature, args.ignore_eos, args.warmup, args.prime_prefix_cache
        )
        del other_engine
        gc.collect()
        name = "pagedllm-prefix-caching-" + ("on" if other else "off")
        systems[name] = {**other_run.metrics(workload), "name": name}
        on, off = (systems[name], systems["pagedllm"]) if other else (systems["pagedllm"], systems[name])
        prefix_comparison = {
            "ttft_p50_on_s": on["ttft_s"]["median"],
            "ttft_p50_off_s": off["ttft_s"]["median"],
            "ttft_p90_on_s": on["ttft_s"]["p90"],
            "ttft_p90_off_s": off["ttft_s"]["p90"],
            "ttft_p50_ratio_off_over_on": ratio(off["ttft_s"]["median"], on["ttft_s"]["median"]),
            "output_tokens_per_s_ratio_on_over_off": ratio(
                on["output_tokens_per_s"], off["output_tokens_per_s"]
            ),
        }

    baseline_results: dict[str, dict[str, Any]] = {}
    if baseline_names:
        hf_model = baselines_module.load_hf_model(config.model, engine_device)
        pad = pad_token_id_for(hf_model, eos_ids)
        for name in baseline_names:
            try:
                if name == "hf-static":
                    res = baselines_module.run_hf_static(
                        hf_model,
                        workload.requests,
                        args.baseline_batch_size,
                        temperature=args.temperature,
                        ignore_eos=args.ignore_eos,
                        eos_token_ids=eos_ids,
                        pad_token_id=pad,
                        seed=config.seed,
                        warmup=args.warmup,
                    )
                else:
                    res = baselines_module.run_hf_cb(
                        hf_model,
                        workload.requests,
                        temperature=args.temperature,
                        ignore_eos=args.ignore_eos,
                        eos_token_ids=eos_ids,
                        pad_token_id=pad,
                        seed=config.seed,
                        max_batch_tokens=args.hf_cb_max_batch_tokens or max_batched,
                    )
            except (RuntimeError, ValueError, MemoryError) as exc:
                logger.error("Baseline %s failed: %s", name, exc)
                baseline_results[name] = {"name": name, "error": str(exc)}
                continue
            baseline_results[name] = res.as_dict()
        del hf_model
        gc.collect()
    if gguf is not None:
        stop = None if args.ignore_eos else eos_ids
        baseline_results[llamacpp.NAME] = llamacpp.throughput_baseline(
            gguf, workload.requests, max_num_seqs, max_batched, stop, args.warmup, args.log_level
        )
    if rerun:
        engine.reset_prefix_cache()  # the second run must not find the first run's prompts cached
        again = run_engine(
            engine, workload, args.temperature, args.ignore_eos, args.warmup, args.prime_prefix_cache
        )
        del engine
        gc.collect()
        systems["pagedllm"] = with_mean_time(systems["pagedllm"], again.metrics(workload))

    engine_metrics = systems["pagedllm"]
    ratios = {}
    for name, base in baseline_results.items():
        if "error" in base:
            continue
        ratios[name] = {
            "requests_per_s": ratio(engine_metrics["requests_per_s"], base["requests_per_s"]),
            "output_tokens_per_s": ratio(engine_metrics["output_tokens_per_s"], base["output_tokens_per_s"]),
            "total_tokens_per_s": ratio(engine_metrics["total_tokens_per_s"], base["total_tokens_per_s"]),
        }

    roofline_section: dict[str, Any] | None = None
    if roofline is not None:
        floor = workload_floor(roofline, workload, max_num_seqs, max_batched)
        fraction = floor["time_floor_s"] / engine_metrics["elapsed_s"]
        measured_threads = roofline.get("machine", {}).get("torch_num_threads")
        warnings = []
        if measured_threads is not None and measured_threads != torch.get_num_threads():
            warnings.append(
                f"the roofline was measured with {measured_threads} torch threads, this run used "
                f"{torch.get_num_threads()}"
            )
        if fraction > 1.0:
            warnings.append(
                "the engine beat the floor, so the roofline measurement does not describe this run "
                "(taken under other load, or too few --gemm-tokens row counts measured)"
            )
        roofline_section = {
            "source": args.roofline_json or "measured in this run",
            **floor,
            "fraction_of_roofline": fraction,
            "total_tokens_per_s_fraction_of_ceiling": ratio(
                engine_metrics["total_tokens_per_s"], floor["total_tokens_per_s_ceiling"]
            ),
            "warnings": warnings,
        }
        if args.measure_roofline:
            roofline_section["measured"] = {
                "gemm": roofline["gemm"],
                "memory_bandwidth_bytes_per_s": roofline["memory_bandwidth_bytes_per_s"],
            }

    _print_report(systems, baseline_results, ratios, prefix_comparison, roofline_section)
    if args.output_json:
        result = {
            "benchmark": "throughput",
            "date": now_iso(),
            "model": model_name,
            "machine": machine_info(),
            "peak_rss_mib": peak_rss_mib(),
            "workload": workload.summary(),
            "sampling": {"temperature": args.temperature, "ignore_eos": args.ignore_eos},
            "engine_config": main_run.config,
            "warmup": args.warmup,
            "prime_prefix_cache": args.prime_prefix_cache,
            "engine": engine_metrics,
            "systems": systems,
            "baselines": baseline_results,
            "ratios": ratios,
            "prefix_caching_comparison": prefix_comparison,
            "roofline": roofline_section,
        }
        write_json(args.output_json, result)
        print(f"\nWrote {args.output_json}")
    return 0


def pad_token_id_for(hf_model: Any, eos_ids: list[int]) -> int:
    pad = getattr(hf_model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = getattr(hf_model.config, "pad_token_id", None)
    if isinstance(pad, list):
        pad = pad[0] if pad else None
    if pad is None:
        pad = eos_ids[0] if eos_ids else 0
    return int(pad)


def _print_report(
    systems: dict[str, dict[str, Any]],
    baselines: dict[str, dict[str, Any]],
    ratios: dict[str, dict[str, float | None]],
    prefix_comparison: dict[str, Any] | None,
    roofline: dict[str, Any] | None,
) -> None:
    rows = []
    for name, m in [*systems.items(), *baselines.items()]:
        if "error" in m:
            rows.append([f"{name} (failed)", None, None, None, None])
            continue
        rows.append(
            [name, m["elapsed_s"], m["requests_per_s"], m["output_tokens_per_s"], m["total_tokens_per_s"]]
        )
    print()
    print(format_table(["system", "time s", "requests/s", "output tok/s", "total tok/s"], rows))
    if ratios:
        print()
        print(
            format_table(
                ["pagedllm vs", "requests/s x", "output tok/s x", "total tok/s x"],
                [
                    [name, r["requests_per_s"], r["output_tokens_per_s"], r["total_tokens_per_s"]]
                    for name, r in ratios.items()
                ],
            )
        )
    for name, m in systems.items():
        if "runs" in m:
            times = " and ".join(f"{r['elapsed_s']:.2f} s" for r in m["runs"])
            print(f"\n{name} ran before and after the baselines ({times}); the table gives their mean.")
        print(f"\n{name}: {_engine_summary(m)}")
        t = m["ttft_s"]
        print(f"  TTFT p50 {t['median'] * 1e3:.1f} ms, p90 {t['p90'] * 1e3:.1f} ms")
    for name, m in baselines.items():
        if "error" in m:
            print(f"\n{name} failed: {m['error']}")
    if prefix_comparison is not None:
        r = prefix_comparison["ttft_p50_ratio_off_over_on"]
        print(
            f"\nPrefix caching: TTFT p50 {prefix_comparison['ttft_p50_on_s'] * 1e3:.1f} ms on vs "
            f"{prefix_comparison['ttft_p50_off_s'] * 1e3:.1f} ms off (off/on = "
            + (f"{r:.2f}x)" if r is not None else "n/a)")
        )
    if roofline is not None:
        print(
            f"\nRoofline ({roofline['bound']}-bound): floor {roofline['time_floor_s']:.2f} s for this workload "
            f"(GEMMs {roofline['gemm_floor_s']:.2f} s + attention {roofline['attention_floor_s']:.2f} s; "
            f"memory {roofline['memory_floor_s']:.2f} s), "
            f"ceiling {roofline['total_tokens_per_s_ceiling']:,.0f} total tok/s; pagedllm reaches "
            f"{roofline['fraction_of_roofline']:.1%} of it."
        )
        for warning in roofline["warnings"]:
            print(f"  Warning: {warning}.")
