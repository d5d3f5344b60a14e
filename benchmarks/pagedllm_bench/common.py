"""Shared pieces of the benchmarks: machine description, device synchronisation, statistics, tables,
JSON output."""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import math
import os
import platform
import resource
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from pagedllm.config import EngineConfig


def machine_info(device: torch.device | None = None) -> dict[str, Any]:
    """The machine and software a measurement was taken on; with ``device``, also that device,
    Triton's version and, on a GPU, its name, memory, multiprocessors and CUDA version."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        affinity = os.cpu_count() or 0
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "processor": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "torch_num_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "python_version": sys.version.split()[0],
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        import transformers

        info["transformers_version"] = transformers.__version__
    except ImportError:  # pragma: no cover - a dependency
        pass
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
    if device is not None:
        info.update(_device_info(device))
    return info


def _device_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"device": str(device)}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            gpu_memory_gib=props.total_memory / 2**30,
            gpu_sms=props.multi_processor_count,
            cuda=torch.version.cuda,
        )
    return info


def synchronize(device: torch.device | None) -> None:
    """Wait for the work queued on ``device`` (a no-op off CUDA)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: torch.device | None) -> None:
    """Collect garbage and, on CUDA, hand the allocator's cached blocks back to the device."""
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def now_iso() -> str:
    """The current local date and time, ISO 8601 with the UTC offset, to the second."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, in MiB (``getrusage`` reports KiB on Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if sys.platform == "darwin":  # pragma: no cover - bytes there
        return peak / 2**20
    return peak / 1024


def distribution(values: Sequence[float], percentiles: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """Mean, median, standard deviation, min, max and percentiles (``p50`` ...) of ``values``.

    An empty sequence gives NaN everywhere (serialized as null).
    """
    out: dict[str, float] = {}
    if len(values) == 0:
        nan = math.nan
        out.update(mean=nan, median=nan, std=nan, min=nan, max=nan)
        out.update({f"p{_pct_name(p)}": nan for p in percentiles})
        return out
    arr = np.asarray(values, dtype=np.float64)
    out.update(
        mean=float(arr.mean()),
        median=float(np.median(arr)),
        std=float(arr.std()),
        min=float(arr.min()),
        max=float(arr.max()),
    )
    for p in percentiles:
        out[f"p{_pct_name(p)}"] = float(np.percentile(arr, p))
    return out


def _pct_name(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p).replace(".", "_")


def ratio(a: float, b: float) -> float | None:
    """``a / b``, or None when ``b`` is zero or either is missing."""
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], left_columns: int = 1) -> str:
    """A plain-text table: the first ``left_columns`` columns left-aligned (labels), the others
    right-aligned (figures); floats get two decimals."""

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            if math.isnan(v):
                return "-"
            return f"{v:,.2f}"
        return str(v)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) if text else len(h) for i, h in enumerate(headers)]
    lines = [
        "  ".join(
            h.ljust(w) if i < left_columns else h.rjust(w)
            for i, (h, w) in enumerate(zip(headers, widths, strict=True))
        )
    ]
    lines.append("  ".join("-" * w for w in widths))
    for r in text:
        lines.append(
            "  ".join(
                c.ljust(w) if i < left_columns else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    return "\n".join(lines)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return str(value)


def _finite(value: Any) -> Any:
    """Replace NaN and infinities by None (JSON has no such numbers), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON (NaN/inf become null), creating the parent directory."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_finite(data), f, indent=2, default=_json_default)
        f.write("\n")


def set_num_threads(num_threads: int | None) -> None:
    """Set torch's intra-op thread count when given (None keeps torch's default)."""
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"--num-threads must be at least 1, got {num_threads}.")
        torch.set_num_threads(num_threads)


def add_run_args(
    parser: argparse.ArgumentParser, *, llama_cpp_threads: bool = False, warmup: bool = False
) -> None:
    """The ``run`` group (threads, ``--warmup``, ``--output-json``, ``--log-level``) and the engine
    arguments, shared by the benchmark commands that run the engine in-process."""
    group = parser.add_argument_group("run")
    if llama_cpp_threads:
        group.add_argument(
            "--num-threads",
            "--threads",
            dest="num_threads",
            type=int,
            default=None,
            help="torch intra-op threads, and llama.cpp's threads (default: torch's default).",
        )
    else:
        group.add_argument(
            "--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's default)."
        )
    if warmup:
        group.add_argument(
            "--warmup",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="Run a short untimed request first on each system (default on).",
        )
    group.add_argument("--output-json", default=None, help="Write the results to this JSON file.")
    group.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="Log level of the engine (default warning).",
    )
    EngineConfig.add_cli_args(parser.add_argument_group("engine"))  # type: ignore[arg-type]


def run_at_log_level(args: argparse.Namespace, body: Callable[[argparse.Namespace], int]) -> int:
    """``body(args)`` with the engine's logger at ``args.log_level`` (restored afterwards)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine_logger = logging.getLogger("pagedllm")
    previous_level = engine_logger.level
    engine_logger.setLevel(args.log_level.upper())
    try:
        return body(args)
    finally:
        engine_logger.setLevel(previous_level)
