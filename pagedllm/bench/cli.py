"""``pagedllm bench {throughput,serve,step,roofline}``: the benchmark subcommands.

Each lives in its own module with ``add_cli_args(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "throughput": (
        "pagedllm.bench.throughput",
        "Offline throughput on a workload, optionally against HF transformers baselines.",
    ),
    "serve": (
        "pagedllm.bench.serve",
        "Online serving benchmark against a running 'pagedllm serve' (streaming /v1/completions).",
    ),
    "step": (
        "pagedllm.bench.step",
        "Time the phases of decode steps at a fixed batch: the engine's overhead outside the forward.",
    ),
    "roofline": (
        "pagedllm.bench.roofline",
        "Measure this machine's GEMM rate and memory bandwidth, and the model's floors.",
    ),
}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``throughput``/``serve``/``roofline`` sub-subcommands to the ``bench`` parser."""
    sub = parser.add_subparsers(
        dest="bench_command", required=True, metavar="{throughput,serve,step,roofline}"
    )
    for name, (module_name, help_text) in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module_name).add_cli_args(p)


def run(args: argparse.Namespace) -> int:
    module_name, _ = BENCHMARKS[args.bench_command]
    return int(importlib.import_module(module_name).run(args) or 0)
