#!/usr/bin/env python
"""pagedllm's GPU checks and benchmarks, all in one run.

1. ``kernels``: the Triton kernels (paged attention on mixed and padded decode batches, KV writes,
   RMSNorm, fused add + RMSNorm, SiLU-and-mul, top-k / top-p thresholds) against torch references on
   random shapes. Unused cache slots hold NaN, and a NaN anywhere in an output fails its case.
2. ``equivalence``: greedy generations of the default model (or ``--model``) against Hugging Face
   transformers on the same weights and dtype, by the logprob-close rule: identical, or at the first
   differing token each side's token is among the other's top-5; then the same comparison between
   the engine with CUDA graphs and with ``enforce_eager``.
3. ``throughput``: a model of Qwen3-0.6B's shape with random weights (written with transformers from
   a config, no download), 256 requests with random token prompts of 100-1024 tokens and outputs of
   100-1024 tokens, EOS ignored, seeded; output tokens per second of ``LLM.generate``.
4. ``decode``: decode steps with 256 running requests, in runs of consecutive steps with and without
   scheduling ahead (``async_scheduling``), and broken down into host work (input preparation,
   sampling, scheduling and output processing) against the forward, with the device synchronised
   around each; the CPU-side share of a step is what the step takes beyond the forward and sampling.
5. ``roofline``: the bytes a decode step must read (weights + KV cache) over the bandwidth of a large
   device-to-device copy, as a fraction of the measured step.
6. ``serve``: the OpenAI server (FastAPI app in this process, in-process client) streaming
   completions of the first 256 workload requests (outputs capped at 256 tokens), against
   ``LLM.generate`` on the same requests: output tokens per second of each.
7. ``hf``: transformers' continuous batching (the manager behind ``generate_batch``) on a subsample of
   the same requests, time-bounded, against the engine on that same subsample.
8. ``serve_processes``: ``pagedllm serve`` as users run it (a core process and 1 or 2 front-end
   processes) streaming the ``serve`` section's requests, against that section's offline run.
9. ``quantization``: weight-only int8 and fp8 against the model dtype (see its module).
10. ``swap``: preemption by swapping to a pinned host tier (``auto``) against recompute, on an
   oversubscribed device pool.

Each section is a module of ``sections/``; this script parses the options, runs the sections in
order and saves the results after each.

Run from the repository root (no installation needed; pagedllm is imported from this checkout)::

    python benchmarks/gpu/run_gpu.py --output-json gpu_results.json

``--tiny`` (alias ``--quick``) shrinks everything (a 2-layer Qwen3-shaped model, 8 requests, short
lengths) so that ``--tiny --device cpu`` runs on a CPU in about a minute. A short table is printed
last; the full results go to ``--output-json`` and, when ``$OUT`` is set, to ``$OUT/gpu_results.json``.
The exit status is 1 when a check fails or a section raises.
"""

import argparse
import dataclasses
import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from sections.common import FULL, SECTIONS, SHARP_INIT, TINY, Deadline, RunState, write_results
from sections.decode import section_decode
from sections.equivalence import section_equivalence
from sections.hf import section_hf
from sections.kernels import section_kernels
from sections.quantization import section_quantization
from sections.random_model import write_random_model
from sections.roofline import section_roofline
from sections.serve import section_serve
from sections.serve_processes import section_serve_processes
from sections.summary import summary_table
from sections.swap import section_swap
from sections.throughput import section_throughput

from pagedllm_bench.common import free_device_memory, machine_info
from pagedllm_bench.workloads import random_workload

logger = logging.getLogger("run_gpu")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", "--quick", dest="tiny", action="store_true", help="tiny model and workload")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--output-json", default="gpu_results.json")
    p.add_argument(
        "--model", default=None, help="checkpoint for the HF equivalence check (default model if unset)"
    )
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--hf-requests", type=int, default=None, help="subsample of the workload for transformers")
    p.add_argument("--hf-timeout-s", type=float, default=None)
    p.add_argument("--time-budget-s", type=float, default=450.0, help="the transformers run is cut to fit")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the workload")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--attention-backend", default=None, choices=["torch", "triton"])
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", default="", help=f"comma-separated sections to skip: {', '.join(SECTIONS)}")
    return p.parse_args(argv)


class Run:
    """One run of the sections, sharing the random-weight model and one engine between them (in
    ``state``), with their results saved after every section."""

    def __init__(self, state: RunState, workdir: str) -> None:
        self.state = state
        self.workdir = workdir
        self.skip = {s.strip() for s in state.args.skip.split(",") if s.strip()}
        self.results: dict[str, Any] = {}

    def wants(self, *sections: str) -> bool:
        return any(s not in self.skip for s in sections)

    def section(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """Run one section (an exception is its result), then save the results so far (a run cut
        short keeps what it measured)."""
        logger.info("== %s ==", name)
        t0 = time.perf_counter()
        out: dict[str, Any] | None
        try:
            out = fn()
        except Exception as exc:
            logger.error("section %s failed: %s", name, exc)
            self.results[name] = {
                "status": "error",
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
                "seconds": time.perf_counter() - t0,
            }
            out = None
        else:
            out.setdefault("seconds", time.perf_counter() - t0)
            self.results[name] = out
        self.save(final=False)
        return out

    def save(self, final: bool) -> None:
        """Write the results to ``--output-json`` and, when ``$OUT`` is set, to ``$OUT/gpu_results.json``."""
        self.results["complete"] = final
        self.results["total_seconds"] = self.state.deadline.elapsed
        write_results(self.state.args.output_json, "gpu_results.json", self.results)

    def random_model(self, name: str, directory: str, **kwargs: Any) -> str | None:
        """Write a random-weight model (the section ``name``); its directory, None when it failed."""
        state = self.state
        info = self.section(
            name,
            lambda: write_random_model(
                device=state.device,
                dtype=state.dtype,
                out_dir=os.path.join(self.workdir, directory),
                **kwargs,
            ),
        )
        return info["path"] if info is not None else None

    def run(self) -> None:
        state, args, settings, device = self.state, self.state.args, self.state.settings, self.state.device
        if self.wants("kernels"):
            self.section("kernels", lambda: section_kernels(settings, device, args.seed))
        # --tiny shares one sharp tiny model between the equivalence check and the benchmarks.
        tiny_reference = args.tiny and args.model is None and self.wants("equivalence")
        if self.wants("throughput", "decode", "roofline", "serve", "hf") or tiny_reference:
            state.model_dir = self.random_model(
                "random_model",
                "qwen3-random",
                shape=settings.shape,
                seed=args.seed,
                initializer_range=SHARP_INIT if args.tiny else 0.02,
            )
        if self.wants("equivalence"):
            self.run_equivalence(tiny_reference)
        if state.model_dir is None or not self.wants("throughput", "decode", "roofline", "serve", "hf"):
            return
        throughput = self.section("throughput", lambda: section_throughput(state, self.wants("throughput")))
        if state.llm is None:
            return
        decode = None
        if self.wants("decode"):
            decode = self.section(
                "decode", lambda: section_decode(state.llm, settings, args.seed, args.temperature)
            )
        if self.wants("roofline"):
            self.section(
                "roofline",
                lambda: section_roofline(
                    state.llm, decode, settings, state.requests, throughput, state.dtype
                ),
            )
        serve = None
        if self.wants("serve"):
            serve = self.section(
                "serve",
                lambda: section_serve(
                    state.llm,
                    state.requests[: settings.serve_requests],
                    args.temperature,
                    settings.serve_max_output,
                ),
            )
        if self.wants("hf") and throughput is not None:
            self.section("hf", lambda: section_hf(state))
        state.llm = None
        if self.wants("serve_processes") and serve is not None:
            free_device_memory(device)  # the server's core process needs the device to itself
            self.section(
                "serve_processes",
                lambda: section_serve_processes(
                    state,
                    settings,
                    state.requests[: settings.serve_requests],
                    args.temperature,
                    settings.serve_max_output,
                    serve,
                    self.workdir,
                ),
            )
        if self.wants("quantization"):  # its own engines, once the shared one has let the GPU go
            self.section("quantization", lambda: section_quantization(state))
        if self.wants("swap"):
            self.section("swap", lambda: section_swap(state))

    def run_equivalence(self, tiny_reference: bool) -> None:
        """Against ``--model``; else the default model when installed; else a small sharp random model."""
        from pagedllm.model.loader import default_model_path

        state, args, settings = self.state, self.state.args, self.state.settings
        reference: str | None = args.model
        random_model = False
        if tiny_reference:
            reference, random_model = state.model_dir, True
            if reference is None:
                self.results["equivalence"] = {"status": "error", "error": "the tiny model was not written"}
                return
        elif args.model is None:
            try:
                default_model_path()
            except FileNotFoundError as exc:
                logger.info("%s; checking equivalence on a small random Qwen3 instead.", exc)
                reference = self.random_model(
                    "equivalence_model",
                    "qwen3-small-sharp",
                    shape=settings.equivalence_shape,
                    seed=args.seed + 1,
                    initializer_range=SHARP_INIT,
                )
                if reference is None:
                    return
                random_model = True
        self.section(
            "equivalence",
            lambda: section_equivalence(settings, state.device, state.dtype_name, reference, random_model),
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    overrides = {
        "num_requests": args.num_requests,
        "hf_requests": args.hf_requests,
        "hf_timeout_s": args.hf_timeout_s,
        "max_num_seqs": args.max_num_seqs,
        "decode_running": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    settings = dataclasses.replace(
        TINY if args.tiny else FULL, **{k: v for k, v in overrides.items() if v is not None}
    )
    unknown = {s.strip() for s in args.skip.split(",") if s.strip()} - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections in --skip: {', '.join(sorted(unknown))}")
    if device.type == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    workload = random_workload(
        settings.num_requests, settings.prompt_len, settings.output_len, settings.shape.vocab_size, args.seed
    )
    state = RunState(
        args=args,
        settings=settings,
        device=device,
        dtype_name=args.dtype or ("bfloat16" if device.type == "cuda" else "float32"),
        requests=workload.requests,
        deadline=Deadline(args.time_budget_s),
    )
    workdir = tempfile.mkdtemp(prefix="pagedllm-gpu-")
    run = Run(state, workdir)
    results = run.results
    results["machine"] = machine_info(device)
    results["settings"] = {
        **{k: v for k, v in dataclasses.asdict(settings).items() if k != "shape"},
        "tiny": args.tiny,
        "dtype": state.dtype_name,
        "temperature": args.temperature,
        "seed": args.seed,
        "skipped_sections": sorted(run.skip),
    }
    try:
        run.run()
    finally:
        state.llm = None
        free_device_memory(device)
        shutil.rmtree(workdir, ignore_errors=True)

    sections = [results.get(s) for s in ("random_model", "equivalence_model", *SECTIONS)]
    errors = [s for s in sections if s is not None and s.get("status") == "error"]
    failed = [s for s in sections if s is not None and s.get("passed") is False]
    results["passed"] = not errors and not failed
    run.save(final=True)
    print(f"\nresults: {os.path.abspath(args.output_json)} ({state.deadline.elapsed:.0f}s)\n", flush=True)
    print(summary_table(results), flush=True)
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
