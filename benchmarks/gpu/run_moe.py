#!/usr/bin/env python
"""The ``moe`` section (``sections/moe.py``) on its own: a random-weight MoE of Qwen3-30B-A3B's
layer shape, the engine on 256 requests against transformers' continuous batching
(``generate_batch``'s manager) and decode steps against their roofline.

Run from the repository root on a machine with a CUDA GPU (no installation needed)::

    python benchmarks/gpu/run_moe.py --output-json moe_results.json

``--tiny --device cpu`` runs a 2-layer, 64-wide model on 6 requests on a CPU (the engine's experts on
the native CPU kernel rather than the Triton grouped GEMM). The results go to ``--output-json`` and,
when ``$OUT`` is set, to ``$OUT/moe_results.json``; a short table is printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from sections.common import write_results  # noqa: E402
from sections.moe import MOE_FULL, MOE_TINY, section_moe, summary_rows  # noqa: E402

from pagedllm_bench.common import format_table, machine_info  # noqa: E402

logger = logging.getLogger("run_moe")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny model and workload (runs on a CPU)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--output-json", default="moe_results.json")
    p.add_argument(
        "--num-layers", type=int, default=None, help="layers of the Qwen3-30B-A3B shape (default 8)"
    )
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--hf-requests", type=int, default=None)
    p.add_argument("--hf-timeout-s", type=float, default=None)
    p.add_argument("--skip-hf", action="store_true", help="no transformers run")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    settings = MOE_TINY if args.tiny else MOE_FULL
    overrides = {
        "num_layers": args.num_layers,
        "num_requests": args.num_requests,
        "hf_requests": args.hf_requests,
        "hf_timeout_s": args.hf_timeout_s,
    }
    settings = dataclasses.replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    results: dict[str, object] = {"machine": machine_info(device), "complete": False}
    t0 = time.perf_counter()
    status = 0
    with tempfile.TemporaryDirectory(prefix="pagedllm-moe-") as workdir:
        try:
            results["moe"] = section_moe(
                settings, device, dtype, workdir, args.seed, args.temperature, args.skip_hf
            )
        except Exception as exc:  # the traceback goes to the results, which a device run sends back
            logger.error("moe failed: %s", exc)
            results["moe"] = {
                "status": "error",
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
            status = 1
    results["complete"] = status == 0
    results["total_seconds"] = time.perf_counter() - t0
    write_results(args.output_json, "moe_results.json", results)
    moe = results["moe"]
    if status == 0 and isinstance(moe, dict):
        print(format_table(["figure", "value"], summary_rows(moe)))
    return status


if __name__ == "__main__":
    sys.exit(main())
