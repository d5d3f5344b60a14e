"""Micro-benchmark: products with GGUF-quantized weights against float32 products of the same layers.

For each distinct linear shape of the default model's GGUF file (its Q4_1 layers, plus the Q8_0 token
embedding used as the LM head with ``--lm-head``), at 1, 8 and 32 rows, times

* ``quant``: :func:`pagedllm.kernels.cpu.quant.quant_matmul` on the weight's own blocks;
* ``panel``: the float32 :class:`~pagedllm.kernels.cpu.linear.PanelLinear` product on the
  dequantized weight (what the engine runs today);
* ``F.linear``: torch's float32 product on the dequantized weight;
* ``dequant``: dequantizing the weight to float32, then ``F.linear`` (the other way to run a product
  of many rows on quantized weights: with ``--rows 256 1024``, is it faster than ``quant``?);

and prints the weight bytes each one reads per second (the quantized blocks, or 4 bytes a value) and
the speed-up of ``quant`` over the other two. By default the weights are read cold, as a decode step
reads them: each call takes the next of enough copies of the layer to overflow the last-level cache
(``--hot`` multiplies one copy again and again instead, from cache). A time is the 10th percentile
of single calls; with as many threads as cores, a machine that other processes keep busy stalls most
parallel calls for a scheduler time slice (milliseconds), so measure on an idle one.

Usage: ``python benchmarks/quant_matmul.py [--threads 2] [--rows 1 8 32] [--hot] [--lm-head]``
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent))  # pagedllm_bench/

from pagedllm.kernels.cpu.linear import PanelLinear  # noqa: E402
from pagedllm.kernels.cpu.quant import QuantizedWeight, dequantize, kernel_isa, quant_matmul  # noqa: E402
from pagedllm.model.loader import default_model_path  # noqa: E402
from pagedllm_bench.common import format_table  # noqa: E402

COLD_BYTES = 96 * 2**20  # more than the last-level cache of the machines this runs on


def layer_shapes(path: Path, lm_head: bool) -> list[tuple[str, QuantizedWeight, int]]:
    """One weight of each distinct (type, out, in) in the file, with how many layers share it."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    found: dict[tuple[str, int, int], tuple[str, QuantizedWeight, int]] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if len(tensor.shape) != 2 or kind not in ("Q4_1", "Q8_0") or (kind == "Q8_0" and not lm_head):
            continue
        key = (kind, int(tensor.shape[1]), int(tensor.shape[0]))
        if key in found:
            name, weight, count = found[key]
            found[key] = (name, weight, count + 1)
        else:
            found[key] = (tensor.name.split(".")[-2], QuantizedWeight.from_gguf(tensor), 1)
    return sorted(found.values(), key=lambda item: (item[1].type_name, item[1].shape))


def copies(nbytes: int, hot: bool) -> int:
    return 1 if hot else max(2, -(-COLD_BYTES // nbytes))


def timed(calls: list[Callable[[], object]], min_time_s: float = 0.3, quantile: float = 0.1) -> float:
    """Time of one call, cycling through ``calls`` (one per weight copy): each call timed on its own
    for ``min_time_s`` (after one pass of warm-up), and the ``quantile`` of those times taken, so that
    calls during which another process held a core (on a loaded machine, or one thread of a parallel
    product waiting out a time slice) do not count."""
    for call in calls:
        call()
    times = []
    clock = time.perf_counter
    end = clock() + min_time_s
    for call in itertools.cycle(calls):
        start = clock()
        call()
        stop = clock()
        times.append(stop - start)
        if stop > end and len(times) >= 20:
            break
    return statistics.quantiles(times, n=100)[int(quantile * 100) - 1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the default model's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--hot", action="store_true", help="one copy of each weight, read from cache")
    parser.add_argument("--lm-head", action="store_true", help="also the Q8_0 token embedding as LM head")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = args.gguf or Path(default_model_path())
    mode = "hot" if args.hot else "cold"
    print(f"{path.name}: threads {args.threads}, kernels {kernel_isa()}, weights {mode}")

    table = []
    for name, weight, count in layer_shapes(path, args.lm_head):
        n, k = weight.shape
        dense = dequantize(weight)
        quant_copies = [
            QuantizedWeight(weight.type_name, weight.shape, weight.blocks.clone())
            for _ in range(copies(weight.nbytes, args.hot))
        ]
        float_copies = [dense.clone() for _ in range(copies(dense.numel() * 4, args.hot))]
        panels = []
        for w in float_copies:
            linear = nn.Linear(k, n, bias=False)
            linear.weight.data = w
            panels.append(PanelLinear(linear))
        for rows in args.rows:
            x = torch.randn(rows, k)
            with torch.inference_mode():
                t_quant = timed([lambda w=w, x=x: quant_matmul(x, w) for w in quant_copies])
                t_panel = timed([lambda p=p, x=x: p(x) for p in panels])
                t_linear = timed([lambda w=w, x=x: F.linear(x, w) for w in float_copies])
                t_dequant = timed([lambda w=w, x=x: F.linear(x, dequantize(w)) for w in quant_copies])
            table.append(
                [
                    f"{name} x{count}",
                    weight.type_name,
                    f"{k}->{n}",
                    rows,
                    t_quant * 1e6,
                    weight.nbytes / t_quant / 1e9,
                    t_panel * 1e6,
                    n * k * 4 / t_panel / 1e9,
                    t_linear * 1e6,
                    n * k * 4 / t_linear / 1e9,
                    t_dequant * 1e6,
                    t_panel / t_quant,
                    t_linear / t_quant,
                    t_dequant / t_quant,
                ]
            )
        del quant_copies, float_copies, panels
    headers = [
        "layer",
        "type",
        "in->out",
        "rows",
        "quant us",
        "GB/s",
        "panel us",
        "GB/s",
        "linear us",
        "GB/s",
        "dequant us",
    ]
    print(format_table([*headers, "vs panel", "vs linear", "vs dequant"], table, left_columns=3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
