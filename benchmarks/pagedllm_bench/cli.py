"""``pagedllm bench {throughput,latency,perplexity,serve,...}``: the benchmark subcommands.

Each lives in its own module with ``add_cli_args(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "throughput": (
        "pagedllm_bench.throughput",
        "Offline throughput on a workload, optionally against HF transformers baselines.",
    ),
    "latency": (
        "pagedllm_bench.latency",
        "Batch-1 prompt processing and decoding speed, optionally against llama.cpp on the same GGUF file.",
    ),
    "perplexity": (
        "pagedllm_bench.perplexity",
        "Perplexity of a text file (default: a shipped public-domain text), optionally against llama.cpp.",
    ),
    "serve": (
        "pagedllm_bench.serve",
        "Online serving benchmark against a running 'pagedllm serve' (streaming /v1/completions).",
    ),
    "lora": (
        "pagedllm_bench.lora",
        "Requests spread over LoRA adapters against the base model alone, and an adapter's load time and memory.",
    ),
    "startup": (
        "pagedllm_bench.startup",
        "Time 'pagedllm serve' from launch to its first healthy answer, and from SIGTERM to exit.",
    ),
    "step": (
        "pagedllm_bench.step",
        "Time the phases of decode steps at a fixed batch: the engine's overhead outside the forward.",
    ),
    "step-time": (
        "pagedllm_bench.step_time",
        "A running stream's longest inter-token gap and long prompts' TTFT, step-time budget against token budget.",
    ),
    "roofline": (
        "pagedllm_bench.roofline",
        "Measure this machine's GEMM rate and memory bandwidth, and the model's floors.",
    ),
    "embed": (
        "pagedllm_bench.embed",
        "Embedding throughput of LLM.embed (default all-MiniLM-L6-v2) against transformers' BertModel.",
    ),
    "prefix-routing": (
        "pagedllm_bench.prefix_routing",
        "Prefix-cache hit rate of data-parallel prefix routing against one core and round-robin.",
    ),
    "moe": (
        "pagedllm_bench.moe",
        "Mixture-of-experts throughput (a random Mixtral-shaped model) against transformers' static batching.",
    ),
    "multiprocess": (
        "pagedllm_bench.multiprocess",
        "Offline throughput with the engine in a core process against in-process, on the same workload.",
    ),
    "spec": (
        "pagedllm_bench.spec",
        "Speculative decoding (prompt lookup) against plain decoding on input-grounded requests.",
    ),
    "swap": (
        "pagedllm_bench.swap",
        "Preemption by swapping KV to the host tier (auto) against recompute, on an oversubscribed KV pool.",
    ),
    "parallel": (
        "pagedllm_bench.parallel",
        "Throughput of tensor/pipeline-parallel ranks against one rank on the same cores, and each rank's "
        "share of the weights.",
    ),
    "scale": (
        "pagedllm_bench.scale",
        "Batch-1 decode, 512-token prompt, 32 sequences, load and memory of a GGUF file against native "
        "llama.cpp (llama-bench, llama-batched-bench), in one table.",
    ),
    "make-model": (
        "pagedllm_bench.make_model",
        "Write a GGUF file of a real model's shape (llama-1b, llama-8b, ...) with random weights, "
        "quantized by llama.cpp's llama-quantize.",
    ),
    "build-llama-cpp": (
        "pagedllm_bench.native",
        "Build the native llama.cpp tools (llama-bench, llama-batched-bench, llama-quantize, llama-server) "
        "once into the cache.",
    ),
}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark sub-subcommands (:data:`BENCHMARKS`) to the ``bench`` parser."""
    sub = parser.add_subparsers(dest="bench_command", required=True, metavar="{" + ",".join(BENCHMARKS) + "}")
    for name, (module_name, help_text) in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module_name).add_cli_args(p)


def run(args: argparse.Namespace) -> int:
    module_name, _ = BENCHMARKS[args.bench_command]
    return int(importlib.import_module(module_name).run(args) or 0)
