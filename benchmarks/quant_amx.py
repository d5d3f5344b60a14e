"""Micro-benchmark: quantized products of many rows on the AMX tiles against the integer kernels.

For the projection shapes of a Llama-3.2-1B-sized model (hidden 2048, FFN 8192, 8 KV heads of 64)
in each block type (random valid blocks), at several row counts, times

* ``int``: :func:`pagedllm.kernels.cpu.quant.quant_matmul` with ``amx=False`` (VNNI / AVX2 integer
  dot products on the blocks);
* ``amx``: the same with ``amx=True`` (a panel of the weight dequantized to bfloat16 per thread, then
  AMX tile products);

in one process, alternating, and prints the best time of each, the GFLOP/s and the ratio. (The engine
takes the tiles for prompt tokens and the integer kernels for every other row, whatever the row
count: :mod:`pagedllm.kernels.cpu.row_paths`.)

Usage: ``python benchmarks/quant_amx.py [--threads 2] [--rows 8 16 24 32 48 64 512] [--types Q4_K Q6_K]
[--cpu-time]``
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers.quant_weights import random_weight  # noqa: E402
from pagedllm.kernels.cpu.quant import amx_available, quant_matmul  # noqa: E402

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}


def best_of(fn: Callable[[], object], repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 24, 32, 48, 64, 512])
    parser.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q8_0", "Q4_0"])
    parser.add_argument("--shapes", nargs="+", default=["o", "gate_up"], choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time by the process's CPU time (with --threads 1: robust to other processes on the machine)",
    )
    args = parser.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    if not amx_available():
        sys.exit("AMX-BF16 is not available here.")
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}")
    head = ["int ms", "amx ms", "int GF/s", "amx GF/s", "amx/int"]
    print(f"{'type':5} {'shape':8} {'rows':>5} " + " ".join(f"{h:>9}" for h in head))
    for type_name in args.types:
        for shape in args.shapes:
            n, k = SHAPES[shape]
            weight, _ = random_weight(type_name, n, k, seed=1)
            for rows in args.rows:
                x = torch.randn(rows, k)
                t_int = best_of(lambda x=x, w=weight: quant_matmul(x, w, amx=False), args.repeats, clock)
                t_amx = best_of(lambda x=x, w=weight: quant_matmul(x, w, amx=True), args.repeats, clock)
                flops = 2.0 * rows * n * k
                print(
                    f"{type_name:5} {shape:8} {rows:5d} {t_int * 1e3:9.2f} {t_amx * 1e3:9.2f} "
                    f"{flops / t_int / 1e9:9.0f} {flops / t_amx / 1e9:9.0f} {t_int / t_amx:8.2f}"
                )


if __name__ == "__main__":
    main()
