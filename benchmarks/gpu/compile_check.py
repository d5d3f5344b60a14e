"""Compile every Triton kernel variant the engine launches on an H200, without a GPU, and report them.

For each model and dtype the model's forward runs on the meta device (shapes only, no data) inside
``pagedllm.kernels.triton.aot.compile_for(H200)``, so each launch is compiled by Triton's JIT for
sm_90 down to the cubin instead of running:

* decode steps as CUDA graphs run them: one forward per batch-size bucket (1, 2, 4, 8, 16, ... up to
  ``--max-num-seqs``), with the launch configuration fixed for any context up to ``--max-model-len``;
* one eager mixed step: prompt chunks (one after a cached prefix) and decodes;
* one sampling step of ``--max-num-seqs`` rows with top-k / top-p filters over Qwen3's vocabulary.

A compile error, a variant needing more shared memory than an H200 block has, or a host read of
device data in the forward (a meta tensor's ``.item()`` raises) fails the run. The report lists each
variant's tiling, shared memory, registers and spills (from ``cuobjdump -res-usage`` on the cubin),
whether its loads are pipelined (asynchronous copies) and which MMA instructions its dots use, and,
per bucket, the attention launch. Run it in a process without ``TRITON_INTERPRET=1``:

    python benchmarks/gpu/compile_check.py --output-json compile_check.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from typing import Any

import torch
import triton
from sections.common import QWEN3_0_6B  # (puts the repository on sys.path)

from pagedllm.attention.base import AttentionMetadata
from pagedllm.attention.triton_backend import TritonAttentionBackend
from pagedllm.kernels.triton import aot as triton_aot
from pagedllm.model.config import ModelConfig
from pagedllm.model.llama import ForwardContext, LlamaForCausalLM
from pagedllm.sample import Sampler, SamplingInputs
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.cuda_graphs import CUDAGraphRunner
from pagedllm_bench.common import write_json

META = torch.device("meta")
BLOCK_SIZE = 16
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# An eager mixed step: a first chunk, a chunk after a 200-token cached prefix, a short prompt and
# three decodes (query tokens, context lengths).
MIXED_QUERY_LENS = [1024, 40, 100, 1, 1, 1]
MIXED_SEQ_LENS = [1024, 240, 100, 50, 700, 17]


def model_config(name: str) -> ModelConfig:
    """One layer of the named model's shape (every layer launches the same kernels)."""
    if name == "qwen3-0.6b":
        shape = dataclasses.asdict(QWEN3_0_6B)
        shape["num_hidden_layers"] = 1
        return ModelConfig(architecture="qwen3", qk_norm=True, tie_word_embeddings=True, **shape)
    if name == "default":
        from pagedllm.model.gguf_loader import gguf_config
        from pagedllm.model.gguf_reader import open_gguf
        from pagedllm.model.loader import default_model_path

        return dataclasses.replace(gguf_config(open_gguf(default_model_path())), num_hidden_layers=1)
    raise ValueError(f"--models: unknown model {name!r} (qwen3-0.6b, default).")


def mixed_metadata(query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
    num_tokens = sum(query_lens)
    return AttentionMetadata(
        slot_mapping=torch.empty(num_tokens, dtype=torch.int64, device=META),
        query_start_loc=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=META),
        seq_lens=torch.empty(len(seq_lens), dtype=torch.int32, device=META),
        block_tables=torch.empty(
            len(seq_lens), max(seq_lens) // BLOCK_SIZE + 1, dtype=torch.int32, device=META
        ),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )


def launch_record(launch: triton_aot.CompiledLaunch) -> dict[str, Any]:
    return {"kernel": launch.kernel, "grid": list(launch.grid), "constants": launch.constants}


def check_model(
    name: str, dtype: torch.dtype, spec: triton_aot.GPUSpec, max_num_seqs: int, max_model_len: int
) -> dict[str, Any]:
    """Compile the decode buckets and a mixed step of one model; the report of that case."""
    cfg = model_config(name)
    max_model_len = min(max_model_len, cfg.max_position_embeddings)
    with META:
        model = LlamaForCausalLM(cfg, max_model_len).to(dtype)
    shape = (4096, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    kv_caches = [(torch.empty(shape, dtype=dtype, device=META), torch.empty(shape, dtype=dtype, device=META))]
    started = time.perf_counter()
    buckets: dict[str, list[dict[str, Any]]] = {}
    with triton_aot.compile_for(spec) as launches:
        runner = CUDAGraphRunner(
            model,
            kv_caches,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            block_size=BLOCK_SIZE,
            device=META,
        )
        runner.capture()  # off CUDA: builds each bucket's static metadata and attention tiling
        for b in runner.batch_sizes:
            first = len(launches)
            hidden, logits = runner.replay(b)
            if hidden.shape != (b, cfg.hidden_size) or logits.shape != (b, cfg.vocab_size):
                raise AssertionError(f"bucket {b}: outputs {tuple(hidden.shape)} / {tuple(logits.shape)}")
            buckets[str(b)] = [launch_record(x) for x in launches[first:]]
        meta = mixed_metadata(MIXED_QUERY_LENS, MIXED_SEQ_LENS)
        tokens = torch.empty(meta.slot_mapping.shape[0], dtype=torch.int64, device=META)
        first = len(launches)
        model(tokens, tokens, ForwardContext(meta, kv_caches, TritonAttentionBackend()))
        mixed = [launch_record(x) for x in launches[first:]]
    return {
        "model": name,
        "dtype": str(dtype).removeprefix("torch."),
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "max_model_len": max_model_len,
        "buckets": buckets,
        "mixed": mixed,
        "variants": variant_records(launches),
        "seconds": round(time.perf_counter() - started, 2),
    }


def check_sampler(spec: triton_aot.GPUSpec, num_rows: int, vocab_size: int) -> dict[str, Any]:
    """Compile what sampling launches on the GPU: top-p rows left open by the first candidate set
    are settled by a Triton kernel (nothing read back, which a meta tensor would refuse)."""
    params = [
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=1000, top_p=0.95),
        SamplingParams(temperature=0.8, top_k=20),
        SamplingParams(temperature=0.0),
    ]
    rows = [params[i % len(params)] for i in range(num_rows)]
    batch = SamplingInputs(
        params=rows,
        prompt_token_ids=[[1, 2, 3]] * num_rows,
        output_token_ids=[[4]] * num_rows,
        generators=[None] * num_rows,
    )
    started = time.perf_counter()
    with triton_aot.compile_for(spec) as launches:
        sampled = Sampler().sample(torch.empty(num_rows, vocab_size, device=META), batch)
    if sampled.token_ids.shape != (num_rows,):
        raise AssertionError(f"sampler: tokens {tuple(sampled.token_ids.shape)}")
    return {
        "model": "sampler",
        "dtype": "float32",
        "num_rows": num_rows,
        "vocab_size": vocab_size,
        "launches": [launch_record(x) for x in launches],
        "variants": variant_records(launches),
        "seconds": round(time.perf_counter() - started, 2),
    }


def variant_records(launches: list[triton_aot.CompiledLaunch]) -> list[dict[str, Any]]:
    """One record per distinct (kernel, constants): tiling, resources and code features."""
    variants: dict[tuple[str, str], dict[str, Any]] = {}
    for launch in launches:
        key = (launch.kernel, json.dumps(launch.constants, sort_keys=True))
        if key not in variants:
            variants[key] = {
                "kernel": launch.kernel,
                "constants": launch.constants,
                "num_warps": launch.num_warps,
                "num_stages": launch.num_stages,
                "shared_bytes": launch.shared_bytes,
                **(triton_aot.resource_usage(launch) or {}),
                **code_features(launch.asm["ttgir"]),
            }
    return list(variants.values())


def code_features(ttgir: str) -> dict[str, Any]:
    """What the GPU code does with its loads and products, from Triton's GPU-level IR: how many
    loads are asynchronous copies into shared memory (software-pipelined ahead of their use), and
    which matrix instructions the dots use (Hopper warp-group MMA, or the older per-warp MMA)."""
    if "ttng.warp_group_dot" in ttgir:
        dot = "wgmma"
    elif "tt.dot " in ttgir:
        dot = "mma"
    else:
        dot = "-"
    return {"async_copies": ttgir.count("ttg.async_copy_global_to_local"), "dot": dot}


def format_table(cases: list[dict[str, Any]]) -> str:
    tiling_keys = (
        "BLOCK_M",
        "TILE_N",
        "NUM_SPLITS",
        "DECODE_ONLY",
        "BLOCK",
        "BLOCK_C",
        "BLOCK_H",
        "NUM_PROBES",
    )
    lines = [
        f"{'case':22} {'kernel':24} {'tiling':52} {'smem B':>7} {'regs':>5} {'spill B':>7} "
        f"{'cp.async':>8} {'dot':>5}"
    ]
    for case in cases:
        label = f"{case['model']} {case['dtype']}"
        for v in case["variants"]:
            tiling = " ".join(f"{k}={v['constants'][k]}" for k in tiling_keys if k in v["constants"])
            lines.append(
                f"{label:22} {v['kernel']:24} {tiling:52} {v['shared_bytes']:>7} "
                f"{v.get('registers', '-'):>5} {v.get('local_bytes', '-'):>7} {v['async_copies']:>8} {v['dot']:>5}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen3-0.6b,default", help="qwen3-0.6b and/or default")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="bfloat16, float16, float32")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    spec = triton_aot.H200
    cases = []
    for name in args.models.split(","):
        for dtype_name in args.dtypes.split(","):
            if dtype_name not in DTYPES:
                parser.error(f"--dtypes: unknown dtype {dtype_name!r} ({', '.join(DTYPES)}).")
            cases.append(check_model(name, DTYPES[dtype_name], spec, args.max_num_seqs, args.max_model_len))
    cases.append(check_sampler(spec, args.max_num_seqs, QWEN3_0_6B.vocab_size))
    report = {
        "target": dataclasses.asdict(spec),
        "triton": triton.__version__,
        "torch": torch.__version__,
        "cases": cases,
    }
    if args.output_json:
        write_json(args.output_json, report)
    print(format_table(cases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
