"""Running the native llama.cpp tools (:mod:`pagedllm_bench.native`) and reading their results.

* :func:`llama_bench`: ``llama-bench`` (``-o json``) for one test, ``pp<N>`` (a prompt of N tokens in
  one batch) or ``tg<N>`` (N tokens generated one at a time from an empty context);
* :func:`batched_bench`: ``llama-batched-bench`` (``--output-format jsonl``): ``npl`` sequences each
  with its own ``npp``-token prompt (all prompts decoded together), then ``ntg`` steps of one token of
  every sequence;
* :func:`best_of_variants`: llama.cpp at its best over the runtime variants that change its speed
  (:data:`VARIANTS`): OpenMP's default waiting or ``OMP_WAIT_POLICY=passive``, and weight repacking on
  (llama.cpp's default) or off (``--repack 0``: the fallback where the repacked path fails). Every
  variant's figure is kept, and the best names the variant it came from; :func:`best_with_fallback`
  tries repacking off only where every repacked run fails.

Every run has a timeout; a tool that fails or times out is a :class:`ToolError` carrying its output's
tail.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedllm_bench.native import NativeTools


class ToolError(RuntimeError):
    """A native tool failed, crashed or timed out."""


@dataclass(frozen=True)
class Variant:
    """A runtime setting of llama.cpp: weight repacking and the OpenMP wait policy (None: default)."""

    repack: bool
    omp_wait_policy: str | None

    @property
    def label(self) -> str:
        return f"repack {'on' if self.repack else 'off'}, OMP wait {self.omp_wait_policy or 'default'}"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if self.omp_wait_policy is not None:
            env["OMP_WAIT_POLICY"] = self.omp_wait_policy
        return env


VARIANTS = (
    Variant(True, None),
    Variant(True, "passive"),
    Variant(False, None),
    Variant(False, "passive"),
)


def run_tool(cmd: Sequence[str], env: dict[str, str] | None, timeout_s: float) -> str:
    """The stdout of a tool run; ToolError with the end of its output when it fails or times out."""
    try:
        proc = subprocess.run(
            list(cmd), env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise ToolError(f"{os.path.basename(cmd[0])} took longer than {timeout_s:.0f} s.") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-1500:]
        raise ToolError(f"{os.path.basename(cmd[0])} failed with status {proc.returncode}: {tail}")
    return proc.stdout


def llama_bench(
    tools: NativeTools,
    model: str,
    threads: int,
    *,
    n_prompt: int = 0,
    n_gen: int = 0,
    repetitions: int = 3,
    variant: Variant = VARIANTS[0],
    timeout_s: float = 1800.0,
) -> dict[str, Any]:
    """One ``llama-bench`` test (exactly one of ``n_prompt``, ``n_gen`` is positive): tokens/s (mean
    and standard deviation over ``repetitions``, each sample), as llama-bench reports them."""
    if (n_prompt > 0) == (n_gen > 0):
        raise ValueError("llama_bench runs one test: a prompt (n_prompt) or a generation (n_gen).")
    cmd = [
        tools.path("llama-bench"),
        "-m",
        model,
        "-t",
        str(threads),
        "-p",
        str(n_prompt),
        "-n",
        str(n_gen),
        "-r",
        str(repetitions),
        "--repack",
        "1" if variant.repack else "0",
        "-o",
        "json",
    ]
    out = run_tool(cmd, variant.env(), timeout_s)
    try:
        tests = json.loads(out)
    except json.JSONDecodeError as exc:
        raise ToolError(f"llama-bench wrote no JSON: {out[-500:]}") from exc
    if len(tests) != 1:
        raise ToolError(f"llama-bench reported {len(tests)} tests, expected 1.")
    t = tests[0]
    return {
        "test": f"pp{n_prompt}" if n_prompt else f"tg{n_gen}",
        "tokens_per_s": float(t["avg_ts"]),
        "stddev_tokens_per_s": float(t["stddev_ts"]),
        "samples_tokens_per_s": [float(x) for x in t.get("samples_ts", [])],
        "threads": int(t["n_threads"]),
        "model_size_bytes": int(t["model_size"]),
        "variant": variant.label,
        "command": " ".join(cmd),
        "cpu_info": t.get("cpu_info"),
        "build": f"{t.get('build_commit')} ({t.get('build_number')})",
    }


def batched_bench(
    tools: NativeTools,
    model: str,
    threads: int,
    *,
    npp: int,
    ntg: int,
    npl: int,
    variant: Variant = VARIANTS[0],
    timeout_s: float = 3600.0,
) -> dict[str, Any]:
    """One ``llama-batched-bench`` point: ``npl`` sequences of ``npp`` prompt + ``ntg`` generated
    tokens. Total tokens/s is ``npl * (npp + ntg)`` over prompt plus generation time."""
    n_ctx = npl * (npp + ntg)
    cmd = [
        tools.path("llama-batched-bench"),
        "-m",
        model,
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-c",
        str(n_ctx),
        "-b",
        "2048",
        "-ub",
        "512",
        "-npp",
        str(npp),
        "-ntg",
        str(ntg),
        "-npl",
        str(npl),
        "--output-format",
        "jsonl",
    ]
    if not variant.repack:
        cmd.append("--no-repack")
    out = run_tool(cmd, variant.env(), timeout_s)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if len(rows) != 1:
        raise ToolError(f"llama-batched-bench reported {len(rows)} results, expected 1: {out[-500:]}")
    r = rows[0]
    elapsed = float(r["t"])
    return {
        "sequences": npl,
        "prompt_len": npp,
        "output_len": ntg,
        "elapsed_s": elapsed,
        "total_tokens_per_s": float(r["speed"]),
        "output_tokens_per_s": npl * ntg / max(elapsed, 1e-9),
        "prompt_s": float(r["t_pp"]),
        "generation_s": float(r["t_tg"]),
        "variant": variant.label,
        "command": " ".join(cmd),
    }


def best_of_variants(
    measure: Callable[[Variant], dict[str, Any]],
    key: str,
    variants: Sequence[Variant] = VARIANTS,
) -> dict[str, Any]:
    """``measure`` under every variant; the result of the highest ``key``, with every variant's figure
    (or its error) under ``"variants"``. ToolError when every variant fails."""
    results: dict[str, Any] = {}
    best: dict[str, Any] | None = None
    for variant in variants:
        try:
            res = measure(variant)
        except ToolError as exc:
            results[variant.label] = {"error": str(exc)[-600:]}
            continue
        results[variant.label] = res[key]
        if best is None or res[key] > best[key]:
            best = res
    if best is None:
        raise ToolError(
            "every variant failed: " + "; ".join(f"{k}: {v['error'][-200:]}" for k, v in results.items())
        )
    return {**best, "variants": results}


def best_with_fallback(
    measure: Callable[[Variant], dict[str, Any]], key: str, always_all: bool = False
) -> dict[str, Any]:
    """llama.cpp at its best: :func:`best_of_variants` over the repacked variants, and over those
    without repacking only when every repacked one fails (``always_all``: over all four at once).
    The fallback's result keeps the repacked runs' error under ``"repacked_error"``."""
    repacked = [v for v in VARIANTS if v.repack]
    plain = [v for v in VARIANTS if not v.repack]
    if always_all:
        return best_of_variants(measure, key, repacked + plain)
    try:
        return best_of_variants(measure, key, repacked)
    except ToolError as exc:
        res = best_of_variants(measure, key, plain)
        res["repacked_error"] = str(exc)[-600:]
        return res
