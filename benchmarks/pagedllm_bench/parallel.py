"""``pagedllm bench parallel``: one model split over tensor/pipeline-parallel ranks against one rank.

Throughput: the workload of ``pagedllm bench throughput`` (by default its 64 random requests of
32–256 prompt and 16–256 output tokens, seed 0, EOS ignored, greedy) runs, in one process and in
turn, on the engine with one rank and ``--num-threads`` torch threads (default: every CPU), then on
the engine split over ``--tensor-parallel-size`` x ``--pipeline-parallel-size`` ranks (on a CPU the
executor gives each rank ``cpu_count // ranks`` threads, so both systems use the same cores), then on
one rank again. Each engine is built, warmed up, timed and shut down before the next is built; the
single rank's figure is the mean of its two times (:func:`pagedllm_bench.throughput.with_mean_time`).
With neither size given, two ranks: tensor parallel 2 when the model splits that way, else pipeline
parallel 2 (the default model's 9 attention heads do not split in two).

Memory: each rank's weights are read in this process as its executor reads them
(:func:`pagedllm.model.loader.load_checkpoint` with the rank's
:func:`pagedllm.distributed.placement.weight_selection`, GGUF blocks kept unless ``--quantization
none``), plus the zero vocabulary rows its runner appends; no rank process is started for it. Each
rank's bytes are held to ``full / N`` (the whole checkpoint's bytes over the ``N`` ranks) plus the
replicated parts it holds: norm weights, K/V projection rows when there are fewer KV heads than
tensor-parallel ranks, the vocabulary padding, and, for a pipeline stage, the excess of its part of
the model (its layers, and for the first stage the vocabulary: embedding and LM head) over an even
share, since stages are balanced by work, not bytes. Rank 0's parameters as the running engine holds them
(``ParallelExecutor.resident_weight_bytes``) are held to the single-rank engine's over ``N`` plus
the same replicated parts.

Reported: output tokens/s of both systems and their ratio (goal: at least 0.8), how many requests got
the same greedy tokens, and per rank: bytes, bound, whether it is within. ``--memory-only`` runs the
memory check alone (no engine, no rank process).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.distributed.placement import RankPlacement, weight_selection
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.kernels.cpu.quant import QuantizedWeight
from pagedllm.model.config import ModelConfig
from pagedllm.model.loader import TensorSelector, load_checkpoint
from pagedllm.worker.parallel_executor import (
    ParallelExecutor,
    check_config,
    model_weight_bytes,
    placement_of,
    read_model_config,
)
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
from pagedllm_bench.throughput import EngineRun, run_engine, with_mean_time
from pagedllm_bench.workloads import Workload, add_workload_args, build_workload

logger = logging.getLogger("pagedllm_bench")

# The throughput goal: the parallel ranks' output tok/s over the single rank's.
THROUGHPUT_GOAL = 0.8
_VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, prefix=False, dataset=False)
    group = parser.add_argument_group("comparison")
    group.add_argument(
        "--single-after-parallel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Run the single rank again after the parallel ranks and use the mean of its two times "
        "(default on).",
    )
    group.add_argument(
        "--memory-check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Read every rank's shard of the checkpoint and check its bytes against full / ranks plus the "
        "replicated parts (default on).",
    )
    group.add_argument(
        "--memory-only",
        action="store_true",
        help="Only the memory check: no engine is built and no rank process started.",
    )
    add_run_args(parser, warmup=True)
    # None: not given (two ranks, chosen by the model's shape); the engine's own default is 1.
    parser.set_defaults(tensor_parallel_size=None, pipeline_parallel_size=None)
    for action in parser._actions:  # the engine group's help says "default 1"; here it is chosen
        if action.dest == "num_threads":
            action.help = "torch threads of the single rank (default: os.cpu_count())."


def parallel_sizes(args: argparse.Namespace, config: EngineConfig) -> tuple[int, int, str]:
    """``(tensor_parallel_size, pipeline_parallel_size, how they were chosen)``; raises ValueError
    for sizes the model cannot take (or a single rank)."""
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    if tp is None and pp is None:
        try:
            check_config(dataclasses.replace(config, tensor_parallel_size=2, pipeline_parallel_size=1))
            return 2, 1, "default: tensor parallel 2"
        except ValueError as exc:
            check_config(dataclasses.replace(config, tensor_parallel_size=1, pipeline_parallel_size=2))
            return 1, 2, f"default: pipeline parallel 2, as {str(exc).rstrip('.')}"
    tp, pp = tp or 1, pp or 1
    if tp * pp < 2:
        raise ValueError("bench parallel compares ranks with one rank: give a world size of at least 2.")
    check_config(dataclasses.replace(config, tensor_parallel_size=tp, pipeline_parallel_size=pp))
    return tp, pp, "given"


def tensor_bytes(weight: torch.Tensor | QuantizedWeight) -> int:
    """Bytes a loaded weight holds: GGUF blocks, or the tensor's elements."""
    if isinstance(weight, QuantizedWeight):
        return weight.nbytes
    return weight.numel() * weight.element_size()


def _replicated_kind(cfg: ModelConfig, placement: RankPlacement, name: str) -> str | None:
    """Which replicated part of the model tensor ``name`` is on ``placement``, if any."""
    if name.endswith("norm.weight"):
        return "norms"
    kv_rows = (".self_attn.k_proj.", ".self_attn.v_proj.")
    if any(part in name for part in kv_rows) and cfg.num_key_value_heads < placement.tp_size:
        return "replicated_kv_heads"
    return None


def _layer_bytes(weights: dict[str, Any]) -> dict[int, int]:
    """Bytes of each layer's tensors (norms left out: they count among the replicated parts)."""
    out: dict[int, int] = {}
    for name, weight in weights.items():
        if name.startswith("model.layers.") and not name.endswith("norm.weight"):
            index = int(name.split(".")[2])
            out[index] = out.get(index, 0) + tensor_bytes(weight)
    return out


def rank_weight_bytes(
    load: Callable[[TensorSelector], dict[str, Any]],
    cfg: ModelConfig,
    placement: RankPlacement,
    full_bytes: int,
    layer_bytes: dict[int, int],
    vocab_bytes: int,
) -> dict[str, Any]:
    """One rank's weight bytes (its checkpoint shard plus vocabulary padding) and their bound.

    ``load(select)`` reads the checkpoint's tensors through a selector; ``full_bytes``,
    ``layer_bytes`` and ``vocab_bytes`` (embedding and LM head) describe the whole checkpoint."""
    world = placement.world_size
    weights = load(lambda name, shape: weight_selection(cfg, placement, name))
    vocab = placement.vocab_range(cfg.vocab_size)
    replicated: dict[str, int] = {"norms": 0, "replicated_kv_heads": 0}
    held = padding = 0
    for name, weight in weights.items():
        size = tensor_bytes(weight)
        held += size
        if name in _VOCAB_TENSORS:  # the runner appends zero rows up to the shard's size
            rows = weight.shape[0]
            padding += max(0, len(vocab) - rows) * size // max(rows, 1)
        kind = _replicated_kind(cfg, placement, name)
        if kind is not None:
            replicated[kind] += size
    del weights
    gc.collect()
    stage = placement.layer_range(cfg.num_hidden_layers)
    stage_bytes = sum(layer_bytes.get(i, 0) for i in stage) + (vocab_bytes if placement.is_first_stage else 0)
    uneven = max(0.0, stage_bytes / placement.tp_size - (sum(layer_bytes.values()) + vocab_bytes) / world)
    replicated["vocab_padding"] = padding
    replicated["uneven_stage"] = int(uneven)
    allowance = sum(replicated.values())
    bound = full_bytes / world + allowance
    total = held + padding
    return {
        "rank": placement.rank,
        "tp_rank": placement.tp_rank,
        "pp_rank": placement.pp_rank,
        "layers": [stage.start, stage.stop],
        "bytes": total,
        "fraction_of_full": total / full_bytes,
        "bound": bound,
        "replicated_bytes": replicated,
        "ok": total <= bound,
    }


def memory_check(
    config: EngineConfig,
    driver_resident: int | None = None,
    single_resident: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Every rank's weight bytes against its bound (see the module docstring); with
    ``driver_resident`` (rank 0's :meth:`ParallelExecutor.resident_weight_bytes`) and
    ``single_resident`` (:func:`resident_bytes` of the single-rank engine), rank 0's resident bytes
    too, whose bound adds the rotary tables."""
    keep = config.quantization != "none"

    def load(select: TensorSelector | None) -> dict[str, Any]:
        return dict(
            load_checkpoint(config.model, config.tokenizer, keep_quantized=keep, select=select).weights
        )

    full = load(None)
    full_bytes = sum(tensor_bytes(w) for w in full.values())
    forms = sorted(
        {
            "GGUF blocks" if isinstance(w, QuantizedWeight) else str(w.dtype).removeprefix("torch.")
            for w in full.values()
        }
    )
    layer_bytes = _layer_bytes(full)
    vocab_bytes = sum(tensor_bytes(full[name]) for name in _VOCAB_TENSORS if name in full)
    cfg = read_model_config(config.model)  # as the executors read it
    del full
    gc.collect()
    ranks = [
        rank_weight_bytes(load, cfg, placement_of(config, cfg, rank), full_bytes, layer_bytes, vocab_bytes)
        for rank in range(config.world_size)
    ]
    result: dict[str, Any] = {
        "weights": " and ".join(forms),
        "full_bytes": full_bytes,
        "world_size": config.world_size,
        "ranks": ranks,
        "all_ok": all(r["ok"] for r in ranks),
    }
    if driver_resident is not None and single_resident is not None:
        single, tables = single_resident
        allowance = sum(ranks[0]["replicated_bytes"].values()) + tables
        bound = single / config.world_size + allowance
        result["driver_resident"] = {
            "bytes": driver_resident,
            "single_rank_bytes": single,
            "rotary_table_bytes": tables,
            "bound": bound,
            "ok": driver_resident <= bound,
        }
    return result


def resident_bytes(engine: LLMEngine) -> tuple[int, int]:
    """Bytes of ``engine``'s model weights (:func:`model_weight_bytes`, as
    :meth:`ParallelExecutor.resident_weight_bytes` counts a rank's), and those of its rotary tables
    among them (every rank holds them whole)."""
    model = engine.runner.model
    tables = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.startswith("rotary."))
    return model_weight_bytes(model), tables


def _timed_run(
    config: EngineConfig, workload: Workload, args: argparse.Namespace, threads: int | None
) -> tuple[EngineRun, LLMEngine]:
    """Build an engine of ``config`` (with ``threads`` torch threads when given), run ``workload``
    on it and return the run and the engine, still up."""
    if threads is not None:
        torch.set_num_threads(threads)
    engine = LLMEngine.from_config(config)
    try:
        run = run_engine(engine, workload, 0.0, True, args.warmup)
    except BaseException:
        engine.shutdown()
        raise
    return run, engine


def _close(engine: LLMEngine) -> None:
    engine.shutdown()
    del engine
    gc.collect()


def _same_tokens(a: EngineRun, b: EngineRun) -> int:
    return sum(
        [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
        for x, y in zip(a.outputs, b.outputs, strict=True)
    )


def run(args: argparse.Namespace) -> int:
    threads = torch.get_num_threads()
    try:
        return run_at_log_level(args, _run)
    finally:
        torch.set_num_threads(threads)  # the parallel executor sets this process's threads


def _run(args: argparse.Namespace) -> int:
    try:
        set_num_threads(args.num_threads)
        single_threads = args.num_threads or os.cpu_count() or 1
        base = EngineConfig.from_cli_args(
            args, tensor_parallel_size=1, pipeline_parallel_size=1, pipeline_layer_partition=None
        )
        tp, pp, chosen = parallel_sizes(args, base)
    except (ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 2
    parallel_config = dataclasses.replace(
        base,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        pipeline_layer_partition=args.pipeline_layer_partition,
    )
    world = tp * pp
    label = f"{world} ranks (TP {tp} x PP {pp})"
    if chosen != "given":
        print(f"Ranks: {chosen}.")
    if args.memory_only:
        checked = memory_check(parallel_config)
        _print_memory(checked)
        if args.output_json:
            sizes = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "world_size": world}
            write_json(
                args.output_json,
                {
                    "benchmark": "parallel",
                    "date": now_iso(),
                    "machine": machine_info(),
                    "parallel": {**sizes, "chosen": chosen},
                    "memory": checked,
                    "goals": {"memory_met": checked["all_ok"]},
                },
            )
            print(f"\nWrote {args.output_json}")
        return 0

    torch.set_num_threads(single_threads)
    engine = LLMEngine.from_config(base)
    try:
        exclude = set(engine.eos_token_ids)
        if engine.model_config.bos_token_id is not None:
            exclude.add(engine.model_config.bos_token_id)
        workload = build_workload(args, engine.vocab_size, engine.tokenizer, exclude)
        if workload.max_total_len > engine.max_model_len:
            raise ValueError(f"a request needs more than max_model_len={engine.max_model_len} tokens.")
        model_name = engine.model_name
        first = run_engine(engine, workload, 0.0, True, args.warmup)
        single_resident = resident_bytes(engine)
    except (ValueError, OSError) as exc:
        _close(engine)
        logger.error("%s", exc)
        return 2
    _close(engine)
    print(
        f"Workload {workload.name}: {len(workload.requests)} requests, {workload.num_prompt_tokens} prompt "
        f"tokens, {workload.num_output_tokens} output tokens; model {model_name}"
    )
    print(f"1 rank x {single_threads} threads: {first.elapsed_s:.2f} s")

    parallel_run, engine = _timed_run(parallel_config, workload, args, None)
    rank_threads = torch.get_num_threads()  # set by the executor: cpu_count // ranks on a CPU
    executor = engine.executor
    driver_resident = executor.resident_weight_bytes() if isinstance(executor, ParallelExecutor) else None
    _close(engine)
    print(f"{label} x {rank_threads} thread(s) each: {parallel_run.elapsed_s:.2f} s")

    single = first.metrics(workload)
    if args.single_after_parallel:
        second, engine = _timed_run(base, workload, args, single_threads)
        _close(engine)
        print(f"1 rank x {single_threads} threads again: {second.elapsed_s:.2f} s")
        single = with_mean_time(single, second.metrics(workload))
    parallel = parallel_run.metrics(workload)
    single.update(name="single", ranks=1, threads=single_threads)
    parallel.update(
        name="parallel",
        ranks=world,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        threads_per_rank=rank_threads,
    )
    speedup = ratio(parallel["output_tokens_per_s"], single["output_tokens_per_s"])
    same = _same_tokens(first, parallel_run)
    torch.set_num_threads(single_threads)  # as the machine description should say

    memory = memory_check(parallel_config, driver_resident, single_resident) if args.memory_check else None
    _print_report(single, parallel, label, speedup, same, memory)
    if args.output_json:
        write_json(
            args.output_json,
            {
                "benchmark": "parallel",
                "date": now_iso(),
                "model": model_name,
                "machine": machine_info(),
                "peak_rss_mib": peak_rss_mib(),
                "workload": workload.summary(),
                "engine_config": first.config,
                "warmup": args.warmup,
                "parallel": {
                    "tensor_parallel_size": tp,
                    "pipeline_parallel_size": pp,
                    "world_size": world,
                    "threads_per_rank": rank_threads,
                    "single_rank_threads": single_threads,
                    "chosen": chosen,
                },
                "systems": {"single": single, "parallel": parallel},
                "ratios": {"output_tokens_per_s": speedup},
                "same_greedy_tokens": {"requests": same, "of": len(workload.requests)},
                "memory": memory,
                "goals": {
                    "output_tokens_per_s_ratio_min": THROUGHPUT_GOAL,
                    "throughput_met": speedup is not None and speedup >= THROUGHPUT_GOAL,
                    "memory_met": memory["all_ok"] if memory is not None else None,
                },
            },
        )
        print(f"\nWrote {args.output_json}")
    return 0


def _mib(n: float) -> float:
    return n / 2**20


def _print_report(
    single: dict[str, Any],
    parallel: dict[str, Any],
    label: str,
    speedup: float | None,
    same: int,
    memory: dict[str, Any] | None,
) -> None:
    rows = [
        [f"1 rank x {single['threads']} threads", single["elapsed_s"], single["output_tokens_per_s"]],
        [
            f"{label} x {parallel['threads_per_rank']} thread(s)",
            parallel["elapsed_s"],
            parallel["output_tokens_per_s"],
        ],
    ]
    print()
    print(format_table(["system", "time s", "output tok/s"], rows))
    if "runs" in single:
        times = " and ".join(f"{r['elapsed_s']:.2f} s" for r in single["runs"])
        print(
            f"The single rank ran before and after the parallel ranks ({times}); the table gives their mean."
        )
    shown = f"{speedup:.3f}x" if speedup is not None else "n/a"
    print(f"parallel / single output tok/s: {shown} (goal >= {THROUGHPUT_GOAL})")
    print(f"Same greedy tokens: {same} of {single['num_requests']} requests")
    if memory is not None:
        print()
        _print_memory(memory)


def _print_memory(memory: dict[str, Any]) -> None:
    rows = []
    for r in memory["ranks"]:
        rows.append(
            [
                str(r["rank"]),
                f"{r['tp_rank']} / {r['pp_rank']}",
                f"{r['layers'][0]}-{r['layers'][1] - 1}",
                _mib(r["bytes"]),
                _mib(r["bound"]),
                f"{r['fraction_of_full']:.1%}",
                "yes" if r["ok"] else "NO",
            ]
        )
    print(
        format_table(
            ["rank", "TP / PP rank", "layers", "weights MiB", "bound MiB", "of full", "within"], rows, 3
        )
    )
    print(
        f"Full checkpoint ({memory['weights']}): {_mib(memory['full_bytes']):.2f} MiB over "
        f"{memory['world_size']} ranks; bound = full / ranks + the replicated parts a rank holds."
    )
    driver = memory.get("driver_resident")
    if driver is not None:
        print(
            f"Rank 0 resident in the engine: {_mib(driver['bytes']):.2f} MiB (one rank: "
            f"{_mib(driver['single_rank_bytes']):.2f} MiB; bound {_mib(driver['bound']):.2f} MiB): "
            + ("within" if driver["ok"] else "NOT within")
        )
