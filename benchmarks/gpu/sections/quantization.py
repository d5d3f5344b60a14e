"""``quantization``: weight-only ``int8`` and ``fp8`` (:mod:`pagedllm.model.weight_quant`) against the
model dtype (bfloat16 on GPUs) on the run's random-weight Qwen3-0.6B-shaped model.

1. ``layers``: the quantized layers on the model's projection shapes, on the device: the int8 forward
   (and ``torch._weight_int8pack_mm`` where the build has a CUDA kernel for it) against the float64
   product with the dequantized weight, the ``torch._scaled_mm`` call against the layer's float32
   reference; then the time of each product (CUDA-graph replays) at 1 to 256 rows against
   ``F.linear`` in the model dtype, summed over a decode step's linears.
2. ``greedy``: an engine per weight format (``quantization`` unset for the baseline, ``int8``,
   ``fp8``), the same 8 seeded random-token prompts, greedy tokens with the top-5 logprobs. The top-5
   rule: a quantized run passes a prompt when each of its tokens, up to and including the first one
   that differs from the baseline's, is among the baseline's top 5 at that position (the tokens
   before the first difference are the baseline's own greedy tokens, so it comes down to the first
   differing token). The two-sided rule of ``greedy_compare`` (each side's token in the other's top
   5) is reported alongside.
3. ``decode``: the ``decode`` section's steady decode steps with ``decode_running`` (256) requests
   running, on each engine: output tokens per second and the ratio to the baseline.

FP8 needs compute capability 8.9+: elsewhere (the CPU of ``--tiny --device cpu``, older GPUs) it is
skipped with the reason. The section fails when an engine or a layer check fails or a prompt breaks
the top-5 rule; the speeds are reported, not judged.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.weight_quant import (
    Fp8Linear,
    Int8Linear,
    check_fp8_supported,
    fp8_supported,
    quantize_activations_fp8,
)
from pagedllm_bench.common import free_device_memory, synchronize
from pagedllm_bench.hf_reference import greedy_compare

from .common import ModelShape, RunState
from .decode import section_decode
from .equivalence import engine_greedy
from .throughput import warm_up

GREEDY_PROMPTS = 8
METHODS = ("int8", "fp8")
TIMED_REPLAYS = 50
# Layer classes that hold quantized weights (the CPU's int8 runs as Q8_0 blocks in QuantLinear).
QUANTIZED_LAYER_CLASSES = ("Int8Linear", "Fp8Linear", "QuantLinear")


def unit_roundoff(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps) / 2


def product_tolerance(k: int, dtype: torch.dtype, roundings: int) -> float:
    """Worst-case error of a length-``k`` float32-accumulated product rounded ``roundings`` times to
    ``dtype``, relative to ``sum |x| |w|`` (which bounds ``|x . w|``): ``gamma_k + roundings * u``."""
    u32 = 2.0**-24
    return k * u32 / (1 - k * u32) + roundings * unit_roundoff(dtype) * (1 + 1e-3)


def projection_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of a decoder layer's four projections and of the LM head."""
    q = shape.num_attention_heads * shape.head_dim
    kv = shape.num_key_value_heads * shape.head_dim
    return {
        "qkv_proj": (shape.hidden_size, q + 2 * kv),
        "o_proj": (q, shape.hidden_size),
        "gate_up_proj": (shape.hidden_size, 2 * shape.intermediate_size),
        "down_proj": (shape.intermediate_size, shape.hidden_size),
        "lm_head": (shape.hidden_size, shape.vocab_size),
    }


def time_ms(fn: Callable[[], Any], device: torch.device, iters: int = TIMED_REPLAYS) -> float:
    """Milliseconds per call of ``fn``: on CUDA as replays of a CUDA graph of one call (as the engine's
    decode steps run; eager calls where capture fails), elsewhere as plain calls."""
    if device.type != "cuda":
        fn()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        return 1e3 * (time.perf_counter() - t) / iters
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
        run: Callable[[], Any] = graph.replay
    except RuntimeError:  # not capturable: eager calls
        run = fn
    run()
    synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / iters


def relative_error(actual: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor) -> float:
    """``max |actual - expected| / (magnitude + tiny)``, inf when ``actual`` has a NaN or inf."""
    a = actual.double()
    if not bool(torch.isfinite(a).all()):
        return math.inf
    return float(((a - expected.double()).abs() / (magnitude.double() + 1e-30)).max())


def check_layers(
    shapes: dict[str, tuple[int, int]], device: torch.device, dtype: torch.dtype, seed: int
) -> dict[str, Any]:
    """Each quantized product on the device against its reference, at 33 rows (not a multiple of 16)
    and at 0 rows (shape only), within the worst-case rounding bound of :func:`product_tolerance`:
    the int8 forward rounds twice to the model dtype, ``_weight_int8pack_mm`` once, and the
    ``_scaled_mm`` call, against the float32 reference, once to bfloat16 (and once more to a model
    dtype other than bfloat16) with a second float32 accumulation order."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows: list[dict[str, Any]] = []
    pack = device.type == "cuda" and bool(
        torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm", "CUDA")
    )
    for name, (k, n) in shapes.items():
        linear = nn.Linear(k, n, bias=False, dtype=dtype, device=device).requires_grad_(False)
        linear.weight.copy_((torch.randn(n, k, generator=g) * 0.02).to(device, dtype))
        x = torch.randn(33, k, generator=g).to(device, dtype)
        int8 = Int8Linear.from_linear(linear)
        w_hat = int8.dequantized_weight().double()
        exact = x.double() @ w_hat.t()
        mag = x.double().abs() @ w_hat.abs().t()
        row: dict[str, Any] = {"layer": name, "in": k, "out": n}
        row["int8_tolerance"] = product_tolerance(k, dtype, 2)
        row["int8_rel_err"] = relative_error(int8(x), exact, mag)
        row["int8_empty_ok"] = tuple(int8(x[:0]).shape) == (0, n)
        checks = [row["int8_rel_err"] <= row["int8_tolerance"], row["int8_empty_ok"]]
        if pack:
            row["int8pack_rel_err"] = relative_error(
                torch._weight_int8pack_mm(x, int8.qweight, int8.scale), exact, mag
            )
            checks.append(row["int8pack_rel_err"] <= product_tolerance(k, dtype, 1))
        del int8, w_hat, exact
        if fp8_supported(device):
            fp8 = Fp8Linear.from_linear(linear)
            ref = fp8.reference_forward(x).float()
            xq, x_scale = quantize_activations_fp8(x)
            fmag = (xq.float().abs() * x_scale) @ fp8.dequantized_weight().abs().t()
            del xq
            row["fp8_tolerance"] = product_tolerance(k, torch.bfloat16, 1) + product_tolerance(
                k, dtype, 0 if dtype == torch.bfloat16 else 1
            )
            row["fp8_rel_err"] = relative_error(fp8.scaled_mm_forward(x), ref, fmag)
            fp8.use_fast_accum = True  # reported only: its accumulation has no float32 bound
            row["fp8_fast_accum_rel_err"] = relative_error(fp8.scaled_mm_forward(x), ref, fmag)
            fp8.use_fast_accum = False
            row["fp8_empty_ok"] = tuple(fp8(x[:0]).shape) == (0, n)
            checks += [row["fp8_rel_err"] <= row["fp8_tolerance"], row["fp8_empty_ok"]]
            del fp8
        row["ok"] = all(checks)
        rows.append(row)
        del linear
        free_device_memory(device)
    return {"cases": rows, "passed": all(r["ok"] for r in rows)}


def time_products(
    linear: nn.Linear,
    int8: Int8Linear,
    fp8: Fp8Linear | None,
    x: torch.Tensor,
    device: torch.device,
    pack: bool,
) -> dict[str, float]:
    """Milliseconds of each product of ``x`` by one weight: ``F.linear`` in the model dtype, the int8
    layer, ``_weight_int8pack_mm`` (when ``pack``), the FP8 layer with and without fast accumulation."""
    ms = {
        "float": time_ms(lambda: F.linear(x, linear.weight), device),
        "int8": time_ms(lambda: int8(x), device),
    }
    if pack:
        ms["int8pack"] = time_ms(lambda: torch._weight_int8pack_mm(x, int8.qweight, int8.scale), device)
    if fp8 is not None:
        ms["fp8"] = time_ms(lambda: fp8(x), device)
        fp8.use_fast_accum = True
        ms["fp8_fast_accum"] = time_ms(lambda: fp8(x), device)
        fp8.use_fast_accum = False
    return ms


def time_layers(
    shapes: dict[str, tuple[int, int]],
    num_layers: int,
    row_counts: tuple[int, ...],
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
) -> dict[str, Any]:
    """Milliseconds of each product per shape and row count, and summed over a decode step's linears
    (``num_layers`` times the four projections, plus the LM head)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    pack = device.type == "cuda" and bool(
        torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm", "CUDA")
    )
    fp8 = fp8_supported(device)
    table: list[dict[str, Any]] = []
    per_step: dict[int, dict[str, float]] = {}
    for name, (k, n) in shapes.items():
        linear = nn.Linear(k, n, bias=False, dtype=dtype, device=device).requires_grad_(False)
        linear.weight.copy_((torch.randn(n, k, generator=g) * 0.02).to(device, dtype))
        int8 = Int8Linear.from_linear(linear)
        fp8_layer = Fp8Linear.from_linear(linear) if fp8 else None
        weight_count = 1 if name == "lm_head" else num_layers
        for rows in row_counts:
            x = torch.randn(rows, k, generator=g).to(device, dtype)
            ms = time_products(linear, int8, fp8_layer, x, device, pack)
            table.append({"layer": name, "rows": rows, "ms": ms})
            step = per_step.setdefault(rows, {})
            for method, value in ms.items():
                step[method] = step.get(method, 0.0) + weight_count * value
            free_device_memory(device)
        del linear, int8, fp8_layer
        free_device_memory(device)
    crossover = [
        rows
        for rows in row_counts
        if all(
            r["ms"].get("int8pack", math.inf) < r["ms"]["int8"]
            for r in table
            if r["rows"] == rows and r["layer"] != "lm_head"
        )
    ]
    return {
        "cuda_graph_replays": device.type == "cuda",
        "products": table,
        "decode_step_linears_ms": {str(rows): v for rows, v in per_step.items()},
        "suggested_int8_pack_mm_max_rows": max(crossover, default=0) if pack else None,
    }


def top5_rule(
    tokens: list[int], base_tokens: list[int], base_tops: list[dict[int, float]]
) -> tuple[str, int | None]:
    """``("identical" | "within_top5" | "outside_top5", first differing index)``: whether the
    quantized run's token at its first difference from the baseline is among the baseline's top 5
    there. Only the common length is compared."""
    for i in range(min(len(tokens), len(base_tokens))):
        if tokens[i] != base_tokens[i]:
            return ("within_top5" if tokens[i] in base_tops[i] else "outside_top5"), i
    return "identical", None


def engine_args(state: RunState) -> dict[str, Any]:
    """The ``throughput`` section's engine arguments (256 sequences on the full run)."""
    settings, args = state.settings, state.args
    return {
        "dtype": state.dtype_name,
        "device": str(state.device),
        "max_num_seqs": settings.max_num_seqs,
        "max_model_len": settings.max_model_len,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "attention_backend": args.attention_backend,
        "enforce_eager": args.enforce_eager,
        "seed": args.seed,
    }


def run_engine(
    state: RunState, method: str | None, prompts: list[list[int]], max_tokens: int
) -> tuple[dict[str, Any], list[tuple[list[int], list[dict[int, float]]]]]:
    """Start an engine with ``quantization=method`` (None: unset, the model as stored), warm it up,
    take the greedy tokens of ``prompts`` and the decode measurement, then release it."""
    from pagedllm import LLM

    extra = {} if method is None else {"quantization": method}
    free_device_memory(state.device)
    t0 = time.perf_counter()
    llm = LLM(state.model_dir, **engine_args(state), **extra)
    startup = time.perf_counter() - t0
    try:
        out, greedy = measure_engine(llm, state, prompts, max_tokens)
    finally:
        del llm
        free_device_memory(state.device)
    return {"startup_s": startup, **out}, greedy


def module_tensor_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (a tied head shares the
    embedding's): the weights on a GPU. (The CPU's GGUF-block layers keep their blocks outside the
    module's tensors, so on the CPU this undercounts.)"""
    storages: dict[int, int] = {}
    for t in (*model.parameters(), *model.buffers()):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def measure_engine(
    llm: Any, state: RunState, prompts: list[list[int]], max_tokens: int
) -> tuple[dict[str, Any], list[tuple[list[int], list[dict[int, float]]]]]:
    """The engine's quantized layers, weight size, KV blocks, greedy tokens and decode speed."""
    settings, args = state.settings, state.args
    engine = llm.llm_engine
    model = engine.runner.model
    out: dict[str, Any] = {
        "quantized_layers": {
            name: sum(type(m).__name__ == name for m in model.modules()) for name in QUANTIZED_LAYER_CLASSES
        },
        "module_tensor_gib": module_tensor_bytes(model) / 2**30,
        "num_kv_blocks": engine.kv_cache_manager.pool.num_blocks,
        "warmup_s": warm_up(llm, engine.vocab_size, settings),
    }
    greedy = engine_greedy(llm, prompts, max_tokens)
    decode = section_decode(llm, settings, args.seed, args.temperature)
    keep = ("num_running", "plain_step_ms", "async_step_ms", "forward_ms", "step_ms")
    out["decode"] = {key: decode[key] for key in keep}
    out["decode_tokens_per_s"] = decode["output_tokens_per_s_at_this_batch"]
    return out, greedy


def greedy_prompts(vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed + 5)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(4, 40))] for _ in range(GREEDY_PROMPTS)]


def compare_greedy(
    runs: list[tuple[list[int], list[dict[int, float]]]], base: list[tuple[list[int], list[dict[int, float]]]]
) -> dict[str, Any]:
    per_prompt = []
    for (tokens, tops), (base_tokens, base_tops) in zip(runs, base, strict=True):
        status, first = top5_rule(tokens, base_tokens, base_tops)
        two_sided, _ = greedy_compare(tokens, tops, base_tokens, base_tops)
        per_prompt.append({"status": status, "first_difference": first, "two_sided": two_sided})
    counts = {
        s: sum(p["status"] == s for p in per_prompt) for s in ("identical", "within_top5", "outside_top5")
    }
    return {"passed": counts["outside_top5"] == 0, **counts, "per_prompt": per_prompt}


def section_quantization(state: RunState) -> dict[str, Any]:
    """The layer checks and timings, then one engine per weight format on ``state.model_dir``."""
    settings, device, dtype = state.settings, state.device, state.dtype
    if state.model_dir is None:
        return {"status": "skipped", "reason": "the random-weight model was not written"}
    t0 = time.perf_counter()
    shapes = projection_shapes(settings.shape)
    full = settings.kernel_scale == "full"
    result: dict[str, Any] = {"dtype": state.dtype_name, "baseline": state.dtype_name}
    try:
        check_fp8_supported(device)
        fp8_reason = None
    except ValueError as exc:
        fp8_reason = str(exc)
    checks: list[bool] = []
    row_counts = (1, 8, 64, 256) if full else (1, 8)
    layer_parts: dict[str, Callable[[], dict[str, Any]]] = {
        "layers": lambda: check_layers(shapes, device, dtype, state.args.seed),
        "layer_times": lambda: time_layers(
            shapes, settings.shape.num_hidden_layers, row_counts, device, dtype, state.args.seed
        ),
    }
    for part, run_part in layer_parts.items():
        try:  # a failing layer part leaves the engines' results
            result[part] = run_part()
        except Exception as exc:
            result[part] = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
            free_device_memory(device)
        checks.append(result[part].get("passed", True))

    prompts = greedy_prompts(settings.shape.vocab_size, state.args.seed)
    engines: dict[str, Any] = {}
    greedy: dict[str, Any] = {}
    base_tokens = None
    for method in (None, *METHODS):
        key = method or state.dtype_name
        if method == "fp8" and fp8_reason is not None:
            engines[key] = {"status": "skipped", "reason": fp8_reason}
            continue
        try:
            engines[key], tokens = run_engine(state, method, prompts, settings.equivalence_tokens)
        except Exception as exc:  # one engine failing leaves the others' results
            engines[key] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
            checks.append(False)
            continue
        if method is None:
            base_tokens = tokens
        elif base_tokens is not None:
            greedy[key] = compare_greedy(tokens, base_tokens)
            checks.append(greedy[key]["passed"])
    result["engines"] = engines
    result["greedy"] = {"prompts": len(prompts), "max_tokens": settings.equivalence_tokens, **greedy}
    base_speed = engines.get(state.dtype_name, {}).get("decode_tokens_per_s")
    result["decode_speedup"] = {
        m: engines[m]["decode_tokens_per_s"] / base_speed
        for m in METHODS
        if base_speed and "decode_tokens_per_s" in engines.get(m, {})
    }
    result["passed"] = all(checks)
    result["status"] = "passed" if result["passed"] else "failed"
    result["seconds"] = time.perf_counter() - t0
    return result


def summary_rows(section: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    """Rows for the run's summary table (``sections/summary.py``)."""
    if section is None or "engines" not in section:
        status = "not run" if section is None else str(section.get("status", "-"))
        return [("quantization", "status", status)]
    rows = [("quantization", "layer checks", "passed" if section["layers"].get("passed") else "FAILED")]
    for method in METHODS:
        g = section["greedy"].get(method)
        engine = section["engines"].get(method, {})
        if g is not None:
            value = f"{g['identical']}/{g['within_top5']}/{g['outside_top5']}"
            rows.append(("quantization", f"{method} greedy identical/top-5/outside", value))
        elif "status" in engine:
            rows.append(
                (
                    "quantization",
                    f"{method}",
                    f"{engine['status']} {engine.get('reason', engine.get('error', ''))[:50]}",
                )
            )
        speedup = section["decode_speedup"].get(method)
        if speedup is not None:
            rows.append(
                ("quantization", f"{method} decode speed vs {section['baseline']}", f"{speedup:.2f}x")
            )
    return rows
