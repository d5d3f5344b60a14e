"""``pagedllm bench roofline``: this machine's limits for the model, to state throughput against.

Two rates are measured with torch on this machine, at the current torch thread count:

* the GEMM rate: ``x @ W.T`` for every linear layer shape of the model (attention projections, MLP,
  LM head), weighted as in one forward pass, for several token counts M (M = the batch size of a
  decode step, or the tokens of a prefill chunk); best of several repetitions;
* the memory bandwidth: copying a large tensor (bytes read + bytes written per second); best of
  several repetitions.

From those and the model's sizes follow the floors (lower bounds on time, so upper bounds on rate):

* a decode step of B sequences with context L reads every weight once and the KV cache of B x L
  tokens: ``max((weight_bytes + B*L*kv_bytes_per_token) / bandwidth, 2*matmul_params*B / gemm(B))``;
* a prefill token costs ``2 * matmul_params`` FLOPs: ``2*matmul_params / gemm(M)``.

where ``gemm(M)`` interpolates the measured rates in log2(M). A whole workload's floor
(:func:`workload_floor`) adds the attention reads of its decode tokens to the GEMM time. Prefill
attention FLOPs, norms, activations and sampling are left out, so the floors are optimistic.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.model.config import ModelConfig
from pagedllm_bench.common import (
    format_table,
    machine_info,
    now_iso,
    set_num_threads,
    synchronize,
    write_json,
)
from pagedllm_bench.workloads import Workload

logger = logging.getLogger("pagedllm_bench")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ModelSizes:
    """Sizes of a model that set its floors.

    ``matmul_params`` are the weights used in matrix products per token (every linear layer and the LM
    head, which is the embedding matrix again when tied); ``weight_bytes`` is what a forward pass reads
    (matmul weights and norms; the embedding lookup reads only a few rows and is left out).
    """

    name: str
    num_params: int
    matmul_params: int
    weight_bytes: int
    kv_bytes_per_token: int
    dtype_bytes: int
    linear_shapes: list[tuple[int, int, int]]  # (out_features, in_features, count per forward pass)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_params": self.num_params,
            "matmul_params": self.matmul_params,
            "weight_bytes": self.weight_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "dtype_bytes": self.dtype_bytes,
            "linear_shapes": [list(s) for s in self.linear_shapes],
        }


def model_sizes(config: ModelConfig, name: str = "model", dtype_bytes: int = 4) -> ModelSizes:
    """Parameter counts, bytes per forward pass and KV bytes per token of a model, from its config."""
    shapes = config.weight_shapes()
    num_params = sum(math.prod(s) for s in shapes.values())
    h = config.hidden_size
    linear: dict[tuple[int, int], int] = {}
    norm_params = 0
    for pname, shape in shapes.items():
        if pname == "model.embed_tokens.weight":
            continue
        if len(shape) == 2:
            linear[shape] = linear.get(shape, 0) + 1  # type: ignore[index]
        else:
            norm_params += math.prod(shape)
    if config.tie_word_embeddings:
        lm_head = (config.vocab_size, h)
        linear[lm_head] = linear.get(lm_head, 0) + 1
    matmul_params = sum(n * k * c for (n, k), c in linear.items())
    kv_bytes = 2 * config.num_hidden_layers * config.kv_size * dtype_bytes
    return ModelSizes(
        name=name,
        num_params=num_params,
        matmul_params=matmul_params,
        weight_bytes=(matmul_params + norm_params) * dtype_bytes,
        kv_bytes_per_token=kv_bytes,
        dtype_bytes=dtype_bytes,
        linear_shapes=[(n, k, c) for (n, k), c in sorted(linear.items())],
    )


def best_time(
    fn: Any,
    repeats: int,
    min_time_s: float,
    device: torch.device | None = None,
    warmup: int = 1,
) -> float:
    """Best wall time of one call of ``fn`` over ``repeats`` timed rounds (each at least ``min_time_s``,
    calling ``fn`` again until it is), after ``warmup`` untimed calls (first-touch allocation, kernel
    selection). On a GPU ``device`` is synchronised before each round and after each call, so that
    the time is the device's."""
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(repeats):
        calls = 0
        synchronize(device)
        start = time.perf_counter()
        while True:
            fn()
            calls += 1
            synchronize(device)
            elapsed = time.perf_counter() - start
            if elapsed >= min_time_s:
                break
        best = min(best, elapsed / calls)
    return best


class _MklPackedLinear(torch.nn.Module):
    """``x @ W.T`` with W pre-packed by MKL for ``rows``-row products, through ``torch.ops.mkl``."""

    def __init__(self, linear: torch.nn.Linear, rows: int) -> None:
        super().__init__()
        self.weight = linear.weight.detach()
        self.rows = rows
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, rows)

    @staticmethod
    def available() -> bool:
        ops = getattr(torch.ops, "mkl", None)
        return (
            torch.backends.mkl.is_available()
            and hasattr(ops, "_mkl_reorder_linear_weight")
            and hasattr(ops, "_mkl_linear")
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, None, self.rows)


def measure_gemm(
    sizes: ModelSizes,
    tokens: int,
    dtype: torch.dtype = torch.float32,
    repeats: int = 3,
    min_time_s: float = 0.2,
) -> dict[str, Any]:
    """FLOP rate of one forward pass's linear layers for ``tokens`` rows, on the model's shapes.

    Each way of multiplying available here is timed: a plain ``F.linear`` (reported as ``matmul``),
    MKL-packed weights through ``torch.ops.mkl`` where torch has them, and for float32 the kernel
    library's panel weights the engine uses (:mod:`pagedllm.kernels.cpu.linear`); the rate is the
    fastest. Each layer is timed on its own, repeatedly, so its weight is cache-hot: an upper bound
    on the rate of a forward pass, which reads each weight once.
    """
    from pagedllm.kernels.cpu.library import kernels_available
    from pagedllm.kernels.cpu.linear import PanelLinear

    weights = [(torch.randn(n, k, dtype=dtype) * 0.02, c) for n, k, c in sizes.linear_shapes]
    inputs = {k: torch.randn(tokens, k, dtype=dtype) for _, k, _ in sizes.linear_shapes}
    plain = []
    for w, _ in weights:
        layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=dtype)
        layer.weight.data = w
        plain.append(layer)
    methods: dict[str, list[torch.nn.Module]] = {"matmul": list(plain)}
    if dtype == torch.float32 and _MklPackedLinear.available():
        methods["mkl-packed"] = [_MklPackedLinear(layer, tokens) for layer in plain]
    if dtype == torch.float32 and kernels_available():
        methods["panels"] = [PanelLinear(layer) for layer in plain]
    flops = sum(2 * tokens * w.shape[0] * w.shape[1] * count for w, count in weights)
    rates: dict[str, float] = {}
    for name, layers in methods.items():
        with torch.inference_mode():
            timed = sum(
                best_time(lambda m=m, x=inputs[w.shape[1]]: m(x), repeats, min_time_s / len(weights)) * count
                for m, (w, count) in zip(layers, weights, strict=True)
            )
        rates[name] = flops / timed
    best = max(rates, key=rates.__getitem__)
    return {
        "tokens": tokens,
        "flops": float(flops),
        "time_s": flops / rates[best],
        "flops_per_s": rates[best],
        "method": best,
        "flops_per_s_by_method": rates,
    }


def measure_bandwidth(
    size_mib: int = 256,
    dtype: torch.dtype = torch.float32,
    repeats: int = 5,
    min_time_s: float = 0.2,
    device: torch.device | None = None,
    warmup: int = 1,
) -> dict[str, float]:
    """Copy bandwidth: bytes read plus bytes written per second for a ``size_mib`` MiB tensor on
    ``device`` (the CPU by default), timed by :func:`best_time`."""
    numel = size_mib * 2**20 // torch.empty((), dtype=dtype).element_size()
    src = torch.rand(numel, device=device).to(dtype)
    dst = torch.empty_like(src)
    t = best_time(lambda: dst.copy_(src), repeats, min_time_s, device, warmup)
    moved = 2 * src.numel() * src.element_size()
    return {"size_mib": size_mib, "bytes_per_copy": float(moved), "time_s": t, "bytes_per_s": moved / t}


def measure_read_bandwidth(
    size_mib: int = 1024, repeats: int = 5, min_time_s: float = 0.2, warmup: int = 1
) -> dict[str, float]:
    """Read bandwidth: bytes read per second summing a ``size_mib`` MiB float32 tensor on the CPU (a
    reduction writes nothing back), timed by :func:`best_time`. The tensor should be several times the
    last-level cache, so the figure is main memory's; a decode step's weight reads run at this rate
    at best."""
    numel = size_mib * 2**20 // 4
    src = torch.rand(numel)
    t = best_time(lambda: src.sum(), repeats, min_time_s, None, warmup)
    read = float(numel * 4)
    return {"size_mib": size_mib, "bytes_per_read": read, "time_s": t, "bytes_per_s": read / t}


def gemm_rate_for(roofline: dict[str, Any], tokens: int) -> float:
    """The GEMM rate for ``tokens`` rows: interpolated linearly in log2(rows) between the measured row
    counts, and the nearest measured rate outside their range."""
    points = sorted((int(g["tokens"]), float(g["flops_per_s"])) for g in roofline["gemm"])
    if tokens <= points[0][0]:
        return points[0][1]
    for (m0, r0), (m1, r1) in zip(points, points[1:], strict=False):
        if tokens <= m1:
            w = (math.log2(tokens) - math.log2(m0)) / (math.log2(m1) - math.log2(m0))
            return r0 + w * (r1 - r0)
    return points[-1][1]


def decode_step_floor(roofline: dict[str, Any], batch: int, context_len: int) -> dict[str, float]:
    """Floor of one decode step of ``batch`` sequences with ``context_len`` tokens of context each."""
    model = roofline["model"]
    bw = float(roofline["memory_bandwidth_bytes_per_s"])
    mem_bytes = model["weight_bytes"] + batch * context_len * model["kv_bytes_per_token"]
    mem_s = mem_bytes / bw
    compute_s = 2 * model["matmul_params"] * batch / gemm_rate_for(roofline, batch)
    step = max(mem_s, compute_s)
    return {
        "batch": batch,
        "context_len": context_len,
        "memory_s": mem_s,
        "compute_s": compute_s,
        "step_floor_s": step,
        "bound": "memory" if mem_s >= compute_s else "compute",
        "tokens_per_s_ceiling": batch / step,
    }


def prefill_token_floor(roofline: dict[str, Any], chunk_tokens: int) -> float:
    """Floor in seconds per prompt token when prompts are computed ``chunk_tokens`` at a time."""
    return 2 * roofline["model"]["matmul_params"] / gemm_rate_for(roofline, chunk_tokens)


def workload_floor(
    roofline: dict[str, Any], workload: Workload, max_num_seqs: int, max_num_batched_tokens: int
) -> dict[str, float]:
    """A lower bound on the time any engine needs for ``workload`` on this machine.

    Compute: the matrix products (every prompt and output token costs ``2 * matmul_params`` FLOPs,
    prompt tokens at the rate of ``max_num_batched_tokens``-row GEMMs, output tokens at the rate of
    ``max_num_seqs``-row ones) plus attention (each output token reads the K/V of its context once,
    at the measured bandwidth; prefill attention FLOPs are left out). A layer runs its projections and
    its attention one after the other, so their times add.
    Memory: at least ``max(longest output, total output / max_num_seqs)`` decode steps, each reading
    every weight, plus the same K/V reads.
    The floor is the larger of the two.
    """
    model = roofline["model"]
    reqs = workload.requests
    batch = max(1, min(max_num_seqs, len(reqs)))
    prompt_tokens = workload.num_prompt_tokens
    output_tokens = workload.num_output_tokens
    gemm_s = prompt_tokens * prefill_token_floor(roofline, max_num_batched_tokens) + (
        output_tokens * 2 * model["matmul_params"] / gemm_rate_for(roofline, batch)
    )
    steps = max(max((r.output_len for r in reqs), default=0), math.ceil(output_tokens / batch))
    kv_tokens_read = sum(r.output_len * r.prompt_len + r.output_len * (r.output_len - 1) // 2 for r in reqs)
    bw = float(roofline["memory_bandwidth_bytes_per_s"])
    attention_s = kv_tokens_read * model["kv_bytes_per_token"] / bw
    compute_s = gemm_s + attention_s
    memory_s = steps * model["weight_bytes"] / bw + attention_s
    total = prompt_tokens + output_tokens
    floor = max(compute_s, memory_s)
    return {
        "gemm_floor_s": gemm_s,
        "attention_floor_s": attention_s,
        "compute_floor_s": compute_s,
        "memory_floor_s": memory_s,
        "time_floor_s": floor,
        "bound": "compute" if compute_s >= memory_s else "memory",
        "total_tokens_per_s_ceiling": total / floor if floor > 0 else math.nan,
        "output_tokens_per_s_ceiling": output_tokens / floor if floor > 0 else math.nan,
    }


def load_roofline(path: str) -> dict[str, Any]:
    """Read a ``pagedllm bench roofline --output-json`` file."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    for key in ("model", "gemm", "memory_bandwidth_bytes_per_s"):
        if key not in data:
            raise ValueError(f"{path} is not a roofline result (no {key!r}).")
    return dict(data)


def measure_roofline(
    config: ModelConfig,
    name: str,
    dtype: str = "float32",
    gemm_tokens: Sequence[int] = (1, 16, 64, 256, 1024),
    bandwidth_mib: int = 256,
    repeats: int = 3,
) -> dict[str, Any]:
    """Measure this machine's GEMM rates and memory bandwidth for ``config`` (see the module docstring)."""
    torch_dtype = DTYPES[dtype]
    sizes = model_sizes(config, name, torch.empty((), dtype=torch_dtype).element_size())
    gemm = [measure_gemm(sizes, m, torch_dtype, repeats) for m in gemm_tokens]
    bw = measure_bandwidth(bandwidth_mib, torch_dtype, max(repeats, 3))
    read = measure_read_bandwidth(max(1024, bandwidth_mib), max(repeats, 3))
    return {
        "memory_read_bandwidth": read,
        "memory_read_bandwidth_bytes_per_s": read["bytes_per_s"],
        "dtype": dtype,
        "model": sizes.as_dict(),
        "gemm": gemm,
        "gemm_flops_per_s": max(g["flops_per_s"] for g in gemm),
        "memory_bandwidth": bw,
        "memory_bandwidth_bytes_per_s": bw["bytes_per_s"],
    }


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="Model whose shapes are measured (default: the default model)."
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="Dtype (default float32).")
    parser.add_argument(
        "--gemm-tokens",
        default="1,16,64,256,1024",
        help="Comma-separated token counts (GEMM rows) to measure (default 1,16,64,256,1024).",
    )
    parser.add_argument(
        "--bandwidth-mib", type=int, default=256, help="Size of the copied tensor in MiB (default 256)."
    )
    parser.add_argument("--repeats", type=int, default=3, help="Timed rounds per measurement (default 3).")
    parser.add_argument(
        "--batch-sizes",
        default="1,8,16,32,64",
        help="Decode batch sizes of the printed floors (default 1,8,16,32,64).",
    )
    parser.add_argument(
        "--context-len",
        type=int,
        default=256,
        help="Context length of the printed decode floors (default 256).",
    )
    parser.add_argument(
        "--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's default)."
    )
    parser.add_argument("--output-json", default=None, help="Write the results to this JSON file.")


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}.") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} must be positive integers, got {text!r}.")
    return values


def run(args: argparse.Namespace) -> int:
    try:
        set_num_threads(args.num_threads)
        gemm_tokens = _int_list(args.gemm_tokens, "--gemm-tokens")
        batch_sizes = _int_list(args.batch_sizes, "--batch-sizes")
        if args.bandwidth_mib < 1 or args.repeats < 1 or args.context_len < 1:
            raise ValueError("--bandwidth-mib, --repeats and --context-len must be positive.")
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    from pagedllm.model.loader import load_checkpoint

    ckpt = load_checkpoint(args.model)
    config, name = ckpt.config, ckpt.name
    del ckpt
    result = measure_roofline(config, name, args.dtype, gemm_tokens, args.bandwidth_mib, args.repeats)
    decode = [decode_step_floor(result, b, args.context_len) for b in batch_sizes]
    prefill_chunk = max(gemm_tokens)
    prefill_s = prefill_token_floor(result, prefill_chunk)
    result.update(
        date=now_iso(),
        machine=machine_info(),
        decode_floors=decode,
        prefill_chunk_tokens=prefill_chunk,
        prefill_floor_s_per_token=prefill_s,
        prefill_tokens_per_s_ceiling=1.0 / prefill_s,
    )
    model = result["model"]
    print(
        f"Model {name}: {model['num_params'] / 1e6:.1f}M parameters ({model['matmul_params'] / 1e6:.1f}M in "
        f"matrix products), {model['weight_bytes'] / 2**20:.0f} MiB of {args.dtype} weights per forward pass, "
        f"{model['kv_bytes_per_token'] / 1024:.1f} KiB of KV cache per token."
    )
    print(f"Machine: {result['machine']['processor']}, torch threads {torch.get_num_threads()}.")
    print()
    print(
        format_table(
            ["GEMM rows", "GFLOP/s"], [[g["tokens"], g["flops_per_s"] / 1e9] for g in result["gemm"]]
        )
    )
    print(f"\nMemory bandwidth (copy, read + write): {result['memory_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s")
    print(f"Memory read bandwidth (sum): {result['memory_read_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s")
    print(
        f"Prefill floor: {prefill_s * 1e3:.3f} ms/token ({1 / prefill_s:,.0f} tokens/s) "
        f"in {prefill_chunk}-token chunks\n"
    )
    print(f"Decode step floors (context {args.context_len} tokens):")
    print(
        format_table(
            ["batch", "memory ms", "compute ms", "floor ms", "bound", "tokens/s ceiling"],
            [
                [
                    d["batch"],
                    d["memory_s"] * 1e3,
                    d["compute_s"] * 1e3,
                    d["step_floor_s"] * 1e3,
                    d["bound"],
                    d["tokens_per_s_ceiling"],
                ]
                for d in decode
            ],
        )
    )
    if args.output_json:
        write_json(args.output_json, result)
        print(f"\nWrote {args.output_json}")
    return 0
