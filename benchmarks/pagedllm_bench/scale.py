"""``pagedllm bench scale``: pagedllm against native llama.cpp on one GGUF file, goal by goal.

Each side runs alone, in processes of its own, one after the other, with the same thread count:
pagedllm in :mod:`pagedllm_bench.scale_engine`, llama.cpp as its own tools
(:mod:`pagedllm_bench.native`, built once). The goals, each a row of one table with the ratio
pagedllm / llama.cpp from this run:

* batch-1 decode tokens/s: 128 tokens from an empty context against ``llama-bench -n 128`` (tg128),
  and each as a share of the roofline: the read bandwidth this machine reaches
  (:func:`pagedllm_bench.roofline.measure_read_bandwidth`) over the bytes a decode step must read
  (every weight a token's forward pass multiplies by, from the file's tensor sizes, plus the float16
  KV cache of the mean context);
* 512-token prompt tokens/s against ``llama-bench -p 512`` (pp512);
* 32 sequences x (128 prompt + 128 output tokens) end to end, total tokens/s, against
  ``llama-batched-bench -npp 128 -ntg 128 -npl 32`` (by default only for files under 1.5 GiB: it
  takes minutes on larger ones);
* resident memory added by loading, once a first request has read every weight, the KV pool set
  apart, against the file's size (llama.cpp: ``llama-server``'s resident memory once it answers
  ``/health``, after its warm-up decode, with its small 1,024-token KV cache), and the time to load (llama.cpp: ``llama-server``'s start to
  ``/health`` answering, its warm-up included);
* batch-1 decode with a busy neighbour, a process spinning on one core started by the benchmark.

llama.cpp is reported at its best over its runtime variants (:data:`pagedllm_bench.native_run.VARIANTS`):
OpenMP's default waiting and ``OMP_WAIT_POLICY=passive``, with weight repacking on; repacking off
(``--repack 0``) is tried only where every repacked variant fails (``--llama-variants all`` tries
it always). Each figure names the variant it came from, and every variant's figure is in the JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from typing import Any

from pagedllm_bench.common import format_table, machine_info, now_iso, ratio, write_json
from pagedllm_bench.native import NativeTools, ensure_tools
from pagedllm_bench.native_run import VARIANTS, ToolError, batched_bench, best_with_fallback, llama_bench
from pagedllm_bench.scale_engine import busy_neighbour
from pagedllm_bench.servers import free_port, llama_server_command, process_memory, start_server, stop_server

logger = logging.getLogger("pagedllm_bench")

BATCH_AUTO_LIMIT_BYTES = int(1.5 * 2**30)


def decode_bytes(path: str) -> dict[str, Any]:
    """What a decode step reads from a GGUF file: the bytes of every tensor a token's forward pass
    multiplies by (all but the token embedding, which is read again as the LM head when tied), and
    the float16 KV cache bytes per token of context."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = str(reader.fields["general.architecture"].contents())

    def meta(key: str) -> int | None:
        field = reader.fields.get(f"{arch}.{key}")
        return int(field.contents()) if field is not None else None

    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    weights = sum(sizes.values())
    if "output.weight" in sizes:
        weights -= sizes.get("token_embd.weight", 0)
    layers = meta("block_count") or 0
    heads = meta("attention.head_count") or 1
    kv_heads = meta("attention.head_count_kv") or heads
    head_dim = meta("attention.key_length") or (meta("embedding_length") or 0) // heads
    return {
        "file_bytes": os.path.getsize(path),
        "weight_bytes_per_step": weights,
        "kv_bytes_per_token": 2 * layers * kv_heads * head_dim * 2,
        "architecture": arch,
        "layers": layers,
    }


def roofline_decode(sizes: dict[str, Any], read_bytes_per_s: float, decode_tokens: int) -> dict[str, float]:
    """The decode ceiling: read bandwidth over a step's bytes at the mean context of ``decode_tokens``
    tokens generated from an empty context."""
    step = sizes["weight_bytes_per_step"] + sizes["kv_bytes_per_token"] * (decode_tokens - 1) / 2
    return {
        "read_bytes_per_s": read_bytes_per_s,
        "bytes_per_step": step,
        "tokens_per_s_ceiling": read_bytes_per_s / step,
    }


def run_engine_side(args: argparse.Namespace, phases: list[str]) -> dict[str, Any]:
    """The pagedllm phases in a process of their own (:mod:`pagedllm_bench.scale_engine`)."""
    with tempfile.TemporaryDirectory(prefix="pagedllm-scale-") as tmp:
        out = os.path.join(tmp, "engine.json")
        cmd = [
            sys.executable,
            "-m",
            "pagedllm_bench.scale_engine",
            "--model",
            args.model,
            "--threads",
            str(args.threads),
            "--phases",
            ",".join(phases),
            "--repeats",
            str(args.repeats),
            "--output-json",
            out,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        proc = subprocess.run(cmd, env=env, timeout=args.timeout, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"the pagedllm side failed with status {proc.returncode} (its log is above).")
        with open(out, encoding="utf-8") as f:
            return dict(json.load(f))


def _best(measure: Any, key: str, args: argparse.Namespace) -> dict[str, Any]:
    return best_with_fallback(measure, key, always_all=args.llama_variants == "all")


def run_llama_side(args: argparse.Namespace, tools: NativeTools, batch: bool) -> dict[str, Any]:
    """The llama.cpp figures (each goal's error, not the whole run, when a tool fails)."""
    out: dict[str, Any] = {}

    def attempt(name: str, fn: Any) -> None:
        try:
            out[name] = fn()
        except (ToolError, RuntimeError) as exc:
            logger.error("llama.cpp %s failed: %s", name, exc)
            out[name] = {"error": str(exc)[-800:]}

    t, m, r = args.threads, args.model, args.repeats
    attempt("load", lambda: _llama_load(args, tools))
    attempt(
        "decode",
        lambda: _best(
            lambda v: llama_bench(tools, m, t, n_gen=128, repetitions=r, variant=v), "tokens_per_s", args
        ),
    )
    attempt(
        "prompt",
        lambda: _best(
            lambda v: llama_bench(tools, m, t, n_prompt=512, repetitions=r, variant=v), "tokens_per_s", args
        ),
    )
    if batch:
        attempt(
            "batch",
            lambda: _best(
                lambda v: batched_bench(tools, m, t, npp=128, ntg=128, npl=32, variant=v),
                "total_tokens_per_s",
                args,
            ),
        )

    def busy() -> dict[str, Any]:
        with busy_neighbour():
            return _best(
                lambda v: llama_bench(tools, m, t, n_gen=128, repetitions=r, variant=v), "tokens_per_s", args
            )

    attempt("busy", busy)
    return out


def _llama_load(args: argparse.Namespace, tools: NativeTools) -> dict[str, Any]:
    """``llama-server``'s time from start to ``/health`` answering 200, and its resident memory then;
    with weight repacking on, else (where the repacked server fails, e.g. in its warm-up decode) off."""
    errors = []
    for variant in (VARIANTS[0], next(v for v in VARIANTS if not v.repack)):
        port = free_port()
        cmd = llama_server_command(
            tools, args.model, port, args.threads, parallel=1, ctx_per_slot=1024, variant=variant
        )
        try:
            server = start_server("llama-server", cmd, f"http://127.0.0.1:{port}", "/health", args.timeout)
        except RuntimeError as exc:
            errors.append(f"{variant.label}: {str(exc)[-300:]}")
            continue
        try:
            mem = process_memory(server.proc.pid)
        finally:
            stop_server(server)
        return {
            "load_s": server.ready_s,
            "rss_added_mib": mem["VmRSS"],
            "rss_anon_added_mib": mem.get("RssAnon"),
            "rss_file_added_mib": mem.get("RssFile"),
            "variant": variant.label,
            "errors": errors,
            "command": " ".join(cmd),
        }
    raise RuntimeError("llama-server did not start: " + "; ".join(errors))


def _get(d: dict[str, Any], *keys: str) -> float | None:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return float(d) if isinstance(d, int | float) else None


def build_table(result: dict[str, Any]) -> list[list[Any]]:
    """The printed rows: goal, pagedllm, llama.cpp, ratio, where llama.cpp's figure came from."""
    e, ll = result["pagedllm"], result["llama.cpp"]
    ceiling = result["roofline"]["tokens_per_s_ceiling"]
    file_mib = result["model_sizes"]["file_bytes"] / 2**20
    rows: list[list[Any]] = []

    def row(goal: str, a: float | None, b: float | None, note: str = "") -> None:
        rows.append([goal, a, b, ratio(a, b) if a is not None and b is not None else None, note])

    def variant(phase: str) -> str:
        v = ll.get(phase, {})
        return str(v.get("variant") or ("error: " + str(v.get("error", ""))[:60] if v else ""))

    row(
        "decode tok/s, batch 1 (tg128)",
        _get(e, "decode", "tokens_per_s"),
        _get(ll, "decode", "tokens_per_s"),
        variant("decode"),
    )
    a, b = _get(e, "decode", "tokens_per_s"), _get(ll, "decode", "tokens_per_s")
    row(
        "decode, % of roofline",
        None if a is None else 100 * a / ceiling,
        None if b is None else 100 * b / ceiling,
        f"ceiling {ceiling:.1f} tok/s",
    )
    row(
        "prompt tok/s, 512 tokens (pp512)",
        _get(e, "prompt", "tokens_per_s"),
        _get(ll, "prompt", "tokens_per_s"),
        variant("prompt"),
    )
    if "batch" in e or "batch" in ll:
        row(
            "32 x (128+128) total tok/s",
            _get(e, "batch", "total_tokens_per_s"),
            _get(ll, "batch", "total_tokens_per_s"),
            variant("batch"),
        )
    row(
        "RSS added, KV pool apart, MiB",
        _get(e, "load", "rss_kv_apart_mib"),
        _get(ll, "load", "rss_added_mib"),
        f"file {file_mib:.0f} MiB; after a first request",
    )
    row(
        "time to load, s",
        _get(e, "load", "load_s"),
        _get(ll, "load", "load_s"),
        "llama.cpp: llama-server to /health",
    )
    row(
        "decode tok/s, busy neighbour",
        _get(e, "busy", "tokens_per_s"),
        _get(ll, "busy", "tokens_per_s"),
        variant("busy"),
    )
    return rows


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, help="The GGUF file (e.g. from 'pagedllm bench make-model')."
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="Threads of both sides (default: the CPU count)."
    )
    parser.add_argument(
        "--batch",
        choices=["auto", "on", "off"],
        default="auto",
        help="The 32-sequence goal: auto runs it for files under 1.5 GiB (default auto).",
    )
    parser.add_argument("--repeats", type=int, default=3, help="Repetitions of each timed test (default 3).")
    parser.add_argument(
        "--llama-variants",
        choices=["best", "all"],
        default="best",
        help="llama.cpp's runtime variants: best tries repacking on with default and passive OpenMP waiting, "
        "and repacking off only where those fail; all always tries all four (default best).",
    )
    parser.add_argument(
        "--read-bandwidth",
        type=float,
        default=None,
        metavar="GB/S",
        help="The memory read bandwidth of the roofline (default: measured here first).",
    )
    parser.add_argument(
        "--timeout", type=float, default=3600.0, help="Seconds each side's process may run (default 3600)."
    )
    parser.add_argument("--output-json", default=None, help="Write the results to this JSON file.")


def _check(args: argparse.Namespace) -> None:
    if not os.path.isfile(args.model) or not args.model.endswith(".gguf"):
        raise ValueError(f"--model must be a GGUF file, got {args.model!r}.")
    if args.threads is None:
        args.threads = os.cpu_count() or 1
    if args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}.")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}.")
    if args.read_bandwidth is not None and args.read_bandwidth <= 0:
        raise ValueError(f"--read-bandwidth must be positive, got {args.read_bandwidth}.")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be positive, got {args.timeout}.")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        _check(args)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    sizes = decode_bytes(args.model)
    batch = args.batch == "on" or (args.batch == "auto" and sizes["file_bytes"] < BATCH_AUTO_LIMIT_BYTES)
    try:
        tools = ensure_tools()
    except RuntimeError as exc:
        logger.error("%s", exc)
        return 1
    if args.read_bandwidth is not None:
        read_bw = args.read_bandwidth * 1e9
    else:
        import torch

        from pagedllm_bench.roofline import measure_read_bandwidth

        torch.set_num_threads(args.threads)
        read_bw = measure_read_bandwidth()["bytes_per_s"]
    phases = ["load", "decode", "prompt", *(["batch"] if batch else []), "busy"]
    print(f"pagedllm: {', '.join(phases)} ...", flush=True)
    try:
        engine = run_engine_side(args, phases)
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
        logger.error("%s", exc)
        engine = {"error": str(exc)}
    print("llama.cpp ...", flush=True)
    llama = run_llama_side(args, tools, batch)
    result: dict[str, Any] = {
        "benchmark": "scale",
        "date": now_iso(),
        "model": os.path.abspath(args.model),
        "threads": args.threads,
        "machine": machine_info(),
        "model_sizes": sizes,
        "roofline": roofline_decode(sizes, read_bw, 128),
        "llama_cpp_tools": str(tools.bin_dir),
        "pagedllm": engine,
        "llama.cpp": llama,
    }
    rows = build_table(result)
    result["table"] = [
        dict(zip(["goal", "pagedllm", "llama.cpp", "ratio", "llama.cpp variant / note"], r, strict=True))
        for r in rows
    ]
    print(
        f"\n{os.path.basename(args.model)}: {sizes['file_bytes'] / 2**20:.0f} MiB, {args.threads} threads, "
        f"read bandwidth {read_bw / 1e9:.1f} GB/s\n"
    )
    print(format_table(["goal", "pagedllm", "llama.cpp", "ratio", "llama.cpp variant / note"], rows))
    if args.output_json:
        write_json(args.output_json, result)
        print(f"\nWrote {args.output_json}")
    return 0
