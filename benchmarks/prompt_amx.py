"""End-to-end prompt benchmark on a Llama-3.2-1B-shaped GGUF: the AMX path of the quantized products
against the integer kernels, in one process.

The model (``--make`` writes it, about 640 MiB): hidden 2048, 16 layers, 32 heads / 8 KV heads, FFN
8192, the default model's 49,152-token vocabulary (its tokenizer is used), random valid blocks in
Q4_K_M's mix (Q4_K; Q6_K for the embedding, which is also the LM head, and for every other layer's
``attn_v`` and ``ffn_down``). Random weights: the speed is that of a real file of these shapes, the
tokens are meaningless.

A prompt of ``--prompt-len`` random tokens is run with one output token (prefix caching off, so that
every run computes the whole prompt), alternately as by default (prompt tokens on the AMX tiles
where the CPU has them) and with ``PAGEDLLM_CPU_AMX=0`` (the integer kernels only; the variable is
read at every step, so one process runs both), ``--runs`` times each; prints the best
time of each, the ratio, the start-up memory split and the resident set after the runs, and with
``--profile`` where one AMX prompt spends its time (cProfile, by function).

Usage: ``python benchmarks/prompt_amx.py MODEL.gguf [--make] [--prompt-len 512] [--runs 3] [--profile]``
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import os
import pstats
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import pagedllm.kernels.cpu.quant as quant  # noqa: E402
from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.model.loader import default_model_path  # noqa: E402


def make_model(
    path: str, layers: int = 16, hidden: int = 2048, ffn: int = 8192, heads: int = 32, kv: int = 8
) -> None:
    import gguf
    from gguf import GGMLQuantizationType

    from helpers.gguf_writer import add_shape_metadata
    from helpers.quant_weights import random_k_blocks

    vocab = 49152
    cfg = SimpleNamespace(
        num_hidden_layers=layers,
        max_position_embeddings=4096,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hidden // heads,
        rms_norm_eps=1e-5,
    )
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    add_shape_metadata(writer, cfg)
    writer.add_rope_freq_base(500000.0)
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def blocks(name: str, rows: int, cols: int, type_name: str) -> None:
        data = random_k_blocks(type_name, rows * cols // 256, rng).reshape(rows, -1)
        writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType[type_name])

    blocks("token_embd.weight", vocab, hidden, "Q6_K")
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    head_dim = hidden // heads
    for i in range(layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        blocks(p + "attn_q.weight", hidden, hidden, "Q4_K")
        blocks(p + "attn_k.weight", kv * head_dim, hidden, "Q4_K")
        blocks(p + "attn_v.weight", kv * head_dim, hidden, "Q6_K" if i % 2 == 0 else "Q4_K")
        blocks(p + "attn_output.weight", hidden, hidden, "Q4_K")
        blocks(p + "ffn_gate.weight", ffn, hidden, "Q4_K")
        blocks(p + "ffn_up.weight", ffn, hidden, "Q4_K")
        blocks(p + "ffn_down.weight", hidden, ffn, "Q6_K" if i % 2 == 0 else "Q4_K")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def resident_mib() -> str:
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS", "RssAnon", "RssFile")):
                fields[line.split(":")[0]] = int(line.split()[1]) // 1024
    return ", ".join(f"{k} {v} MiB" for k, v in fields.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--make", action="store_true", help="write the model file first")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if args.make:
        make_model(args.model)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("pagedllm").setLevel(logging.INFO)
    started = time.perf_counter()
    llm = LLM(
        args.model,
        tokenizer=str(default_model_path()),
        num_kv_blocks=(args.prompt_len + 1) // 16 + 2,
        max_model_len=max(2048, args.prompt_len + 1),
        max_num_batched_tokens=max(2048, args.prompt_len),
        enable_prefix_caching=False,
    )
    print(
        f"loaded in {time.perf_counter() - started:.1f} s; file {os.path.getsize(args.model) / 2**20:.0f} MiB"
    )
    gen = torch.Generator().manual_seed(0)
    prompt = [1, *torch.randint(3, 40000, (args.prompt_len - 1,), generator=gen).tolist()]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    saved = os.environ.get(quant.AMX_ENV)
    best = {"amx": float("inf"), "int": float("inf")}
    for run in range(args.runs + 1):  # the first pair warms up
        for mode in ("amx", "int"):
            os.environ[quant.AMX_ENV] = "1" if mode == "amx" else "0"
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            if run:
                best[mode] = min(best[mode], time.perf_counter() - start)
    if saved is None:
        del os.environ[quant.AMX_ENV]
    else:
        os.environ[quant.AMX_ENV] = saved
    n = args.prompt_len
    print(f"default (AMX tiles: {quant.amx_available()}): {best['amx']:.3f} s, {n / best['amx']:.1f} tok/s")
    print(f"{quant.AMX_ENV}=0 (integer kernels): {best['int']:.3f} s, {n / best['int']:.1f} tok/s")
    print(f"ratio: {best['int'] / best['amx']:.2f}x; {resident_mib()} (isa: {quant.kernel_isa()})")
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        llm.generate([prompt], params, use_tqdm=False)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
