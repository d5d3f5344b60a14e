"""``swap``: preemption by swapping KV to the host tier (``preemption_mode="auto"`` with a pinned
host tier) against recompute, on the run's random-weight model with a device pool far smaller than
the workload's KV (:func:`pagedllm_bench.swap.compare`, the ``pagedllm bench swap`` comparison).

Full: 64 requests at once, prompts of 512-1024 and outputs of 256-512 tokens, 1,024 device blocks
(16,384 tokens of the ~96,000 the requests reach) and a 24 GiB host tier. The goal is auto finishing
in less time than recompute; the section fails when an engine fails, not on the figure.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm_bench.swap import compare
from pagedllm_bench.workloads import random_workload

from .common import RunState

FULL_SHAPE = {"num_prompts": 64, "input_len": (512, 1024), "output_len": (256, 512), "num_kv_blocks": 1024}
TINY_SHAPE = {"num_prompts": 6, "input_len": (32, 64), "output_len": (16, 32), "num_kv_blocks": 12}


def section_swap(state: RunState) -> dict[str, Any]:
    if state.model_dir is None:
        return {"status": "skipped", "reason": "the random-weight model was not written"}
    t0 = time.perf_counter()
    full = state.settings.kernel_scale == "full"
    shape = FULL_SHAPE if full else TINY_SHAPE
    base = EngineConfig(
        model=state.model_dir,
        dtype=state.dtype_name,
        device=state.device.type,
        num_kv_blocks=shape["num_kv_blocks"],
        max_num_seqs=shape["num_prompts"],
        max_model_len=state.settings.max_model_len,
        swap_space=24.0 if full else 0.05,
        seed=state.args.seed,
    )
    workload = random_workload(
        shape["num_prompts"],
        shape["input_len"],
        shape["output_len"],
        state.settings.shape.vocab_size,
        state.args.seed,
    )
    result = compare(dataclasses.replace(base), workload)
    speedup = result["speedup"]
    result.update(
        workload=workload.summary(),
        goal_met=speedup is not None and speedup > 1.0,
        passed=True,
        status="passed",
        seconds=time.perf_counter() - t0,
    )
    return result


def summary_rows(section: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    """Rows for the run's summary table (``sections/summary.py``)."""
    if section is None or "systems" not in section:
        return [("swap", "status", "not run" if section is None else str(section.get("status", "-")))]
    s = section["systems"]
    return [
        ("swap", "recompute / auto seconds", f"{s['recompute']['seconds']:.1f} / {s['auto']['seconds']:.1f}"),
        ("swap", "auto swaps out / in", f"{s['auto']['swapped_out']} / {s['auto']['swapped_in']}"),
        ("swap", "auto against recompute (goal > 1)", f"{section['speedup']:.2f}x"),
    ]
