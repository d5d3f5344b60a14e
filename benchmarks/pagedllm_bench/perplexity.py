"""``pagedllm bench perplexity [FILE]``: perplexity of a text under the engine, optionally against
llama.cpp on the same GGUF file, windows and tokens.

The text (by default the shipped ``texts/us_constitution.txt``, see ``texts/README.md``) is tokenized
once by the model's tokenizer, without special tokens, and cut into consecutive windows that do not
overlap. When the tokenizer adds a BOS token to what it encodes (``add_bos_token``; for GGUF files
``tokenizer.ggml.add_bos_token``), every window is a BOS followed by ``--context - 1`` text tokens;
otherwise a window is ``--context`` text tokens. Each window is scored from an empty cache on all of
its tokens after the first: position ``i`` predicts token ``i + 1``. The last, shorter window is kept
when it has a token to score, so with a BOS every token of the text is scored exactly once.

llama.cpp's own ``llama-perplexity`` tool differs on purpose: it overwrites the first token of each
chunk with BOS (dropping that text token) instead of prepending one, and scores only the second half
of each chunk so that every scored token has at least ``n_ctx / 2`` tokens of context; its figures are
therefore lower than these and not comparable. Here both engines see exactly the same token windows
and are scored on the same positions, so their perplexities may be compared directly.

The engine's figure comes from prompt logprobs (``SamplingParams(max_tokens=1, prompt_logprobs=0)``:
each prompt position's log-probability of the actual next token, computed by the engine in its
dtype); llama.cpp's from the logits of every position, log-softmaxed here in float64. Reported: both
perplexities, the relative difference of the engine's from llama.cpp's, and each one's scored tokens
per second: for the engine the whole run, all windows queued at once; for llama.cpp the
``llama_decode`` calls, one window each, and the copies of their logits (the float64 scoring here is
left out); and the CPU cores each used over its timed part (CPU seconds of the process per second:
well below the thread count means other processes took the cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.outputs import PromptLogprobs
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm_bench import llamacpp
from pagedllm_bench.common import (
    add_run_args,
    format_table,
    machine_info,
    now_iso,
    peak_rss_mib,
    run_at_log_level,
    set_num_threads,
    write_json,
)

logger = logging.getLogger("pagedllm_bench")

DEFAULT_TEXT = Path(__file__).resolve().parent / "texts" / "us_constitution.txt"


def make_windows(token_ids: Sequence[int], context: int, bos_token_id: int | None) -> list[list[int]]:
    """Cut ``token_ids`` into consecutive windows of at most ``context`` tokens, each starting with
    ``bos_token_id`` when one is given (then holding ``context - 1`` text tokens); a window with
    nothing to score (a single token) is dropped."""
    if context < 2:
        raise ValueError(f"--context must be at least 2 (a token and the one it predicts), got {context}.")
    step = context - 1 if bos_token_id is not None else context
    prefix = [bos_token_id] if bos_token_id is not None else []
    windows = [prefix + list(token_ids[i : i + step]) for i in range(0, len(token_ids), step)]
    return [w for w in windows if len(w) >= 2]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (the maximum subtracted first)."""
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def nll_from_logits(logits: np.ndarray, window: Sequence[int]) -> float:
    """Summed negative log-likelihood of ``window[1:]`` given the logits of every position of
    ``window`` (row ``i`` predicts token ``i + 1``; the last row is unused)."""
    if len(logits) != len(window):
        raise ValueError(f"{len(logits)} logits rows for a window of {len(window)} tokens.")
    logprobs = log_softmax(logits[:-1])
    targets = np.asarray(window[1:], dtype=np.int64)
    return float(-logprobs[np.arange(len(targets)), targets].sum())


def nll_from_prompt_logprobs(prompt_logprobs: PromptLogprobs, window: Sequence[int]) -> float:
    """Summed negative log-likelihood of ``window[1:]`` from an engine request's prompt logprobs
    (entry ``i`` holds the log-probability of prompt token ``i``; entry 0 is None)."""
    if len(prompt_logprobs) != len(window):
        raise ValueError(f"{len(prompt_logprobs)} prompt logprobs for a window of {len(window)} tokens.")
    total = 0.0
    for i in range(1, len(window)):
        entry = prompt_logprobs[i]
        if entry is None or window[i] not in entry:
            raise ValueError(f"no prompt logprob for token {window[i]} at position {i}.")
        total -= entry[window[i]].logprob
    return total


@dataclass
class PerplexityResult:
    """Summed negative log-likelihood over the scored tokens of all windows, and the time it took."""

    name: str
    nll: float
    tokens_scored: int
    num_windows: int
    elapsed_s: float
    cpu_s: float = math.nan  # CPU seconds of the process (all threads) within elapsed_s

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens_scored) if self.tokens_scored else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "perplexity": self.perplexity,
            "mean_nll": self.nll / self.tokens_scored if self.tokens_scored else float("nan"),
            "tokens_scored": self.tokens_scored,
            "num_windows": self.num_windows,
            "elapsed_s": self.elapsed_s,
            "scored_tokens_per_s": self.tokens_scored / max(self.elapsed_s, 1e-9),
            "cpu_cores_used": self.cpu_s / max(self.elapsed_s, 1e-9),
        }


def tokenizer_bos(tokenizer: Any) -> int | None:
    """The BOS id when the tokenizer puts one before what it encodes, else None."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return None
    with_special = list(tokenizer.encode("a", add_special_tokens=True))
    without = list(tokenizer.encode("a", add_special_tokens=False))
    return int(bos) if with_special[:1] == [bos] and without[:1] != [bos] else None


def engine_perplexity(engine: LLMEngine, windows: list[list[int]]) -> PerplexityResult:
    """Score every window with the engine's prompt logprobs, all windows queued at once."""
    params = SamplingParams(
        temperature=0.0,
        max_tokens=1,
        prompt_logprobs=0,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    ids = [f"ppl-{i}" for i in range(len(windows))]
    finished: dict[str, Any] = {}
    cpu = time.process_time()
    start = time.perf_counter()
    try:
        for rid, window in zip(ids, windows, strict=True):
            engine.add_request(rid, window, params)
        while len(finished) < len(ids):
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            if len(finished) < len(ids) and not engine.has_unfinished_requests():
                raise RuntimeError("the engine went idle with windows unscored.")
    except BaseException:
        engine.abort_request([i for i in ids if i not in finished])
        raise
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu
    nll = 0.0
    for rid, window in zip(ids, windows, strict=True):
        lps = finished[rid].prompt_logprobs
        if lps is None:
            raise RuntimeError(f"the engine returned no prompt logprobs for {rid}.")
        nll += nll_from_prompt_logprobs(lps, window)
    scored = sum(len(w) - 1 for w in windows)
    return PerplexityResult("pagedllm", nll, scored, len(windows), elapsed, cpu)


def llamacpp_perplexity(
    path: str, windows: list[list[int]], threads: int, bos_token_id: int | None = None
) -> PerplexityResult:
    """Score every window with llama.cpp's logits of every position (float64 log-softmax here);
    ``bos_token_id`` is the one the windows start with, if any (checked against llama.cpp's vocabulary)."""
    with llamacpp.LlamaCppModel(path, threads) as model:
        if model.add_bos != (bos_token_id is not None):
            logger.warning(
                "llama.cpp's vocabulary says add_bos=%s, the model's tokenizer the opposite; both score "
                "the same windows, which follow the tokenizer.",
                model.add_bos,
            )
        longest = max(len(w) for w in windows)
        with llamacpp.perplexity_context(model, longest) as ctx:
            llamacpp.window_logits(ctx, windows[0][:8])  # warm-up, untimed
            nll = 0.0
            elapsed = cpu = 0.0
            for window in windows:
                cpu -= time.process_time()
                start = time.perf_counter()
                logits = llamacpp.window_logits(ctx, window)
                elapsed += time.perf_counter() - start
                cpu += time.process_time()
                nll += nll_from_logits(logits, window)
    scored = sum(len(w) - 1 for w in windows)
    return PerplexityResult(llamacpp.NAME, nll, scored, len(windows), elapsed, cpu)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "file",
        nargs="?",
        default=None,
        metavar="FILE",
        help=f"UTF-8 text file to score (default: the shipped {DEFAULT_TEXT.name}).",
    )
    group = parser.add_argument_group("perplexity")
    group.add_argument(
        "--context", type=int, default=512, help="Tokens per window, a BOS included (default 512)."
    )
    group.add_argument(
        "--max-windows", type=int, default=None, help="Score only the first N windows (default: all)."
    )
    group.add_argument(
        "--baseline",
        default=None,
        choices=[llamacpp.NAME, llamacpp.NATIVE_NAME],
        help="llama.cpp-python: also score the same windows with llama.cpp through its Python binding on the "
        "same GGUF file (needs the llamacpp extra).",
    )
    add_run_args(parser, llama_cpp_threads=True)


def run(args: argparse.Namespace) -> int:
    return run_at_log_level(args, _run)


def _run(args: argparse.Namespace) -> int:
    path = Path(args.file) if args.file else DEFAULT_TEXT
    try:
        set_num_threads(args.num_threads)
        if args.max_windows is not None and args.max_windows < 1:
            raise ValueError(f"--max-windows must be at least 1, got {args.max_windows}.")
        config = EngineConfig.from_cli_args(args)
        if args.baseline == llamacpp.NATIVE_NAME:
            raise ValueError(llamacpp.native_refusal("perplexity"))
        gguf = llamacpp.check_baseline(config.model) if args.baseline else None
        text = path.read_text(encoding="utf-8")
    except (ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 2
    llamacpp.set_log_level(args.log_level)
    engine = LLMEngine.from_config(config)
    try:
        bos = tokenizer_bos(engine.tokenizer)
        token_ids = list(engine.tokenizer.encode(text, add_special_tokens=False))
        windows = make_windows(token_ids, args.context, bos)[: args.max_windows]
        if not windows:
            raise ValueError(f"{path} has no token to score.")
        if args.context + 1 > engine.max_model_len:
            raise ValueError(
                f"--context {args.context} leaves no room within max_model_len={engine.max_model_len}."
            )
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    print(
        f"{path.name}: {len(token_ids)} tokens, {len(windows)} windows of up to {args.context} tokens "
        f"({'a BOS and ' if bos is not None else ''}{sum(len(w) - 1 for w in windows)} scored tokens)"
    )
    results = {"pagedllm": engine_perplexity(engine, windows).as_dict()}
    model_name = engine.model_name
    engine_config = dataclasses.asdict(engine.config)
    engine_dtype = str(engine.executor.dtype).removeprefix("torch.")
    threads = torch.get_num_threads()
    del engine
    if gguf is not None:
        try:
            results[llamacpp.NAME] = llamacpp_perplexity(gguf, windows, threads, bos).as_dict()
        except (RuntimeError, ValueError, MemoryError) as exc:
            logger.error("Baseline %s failed: %s", llamacpp.NAME, exc)
            results[llamacpp.NAME] = {"name": llamacpp.NAME, "error": str(exc)}
    comparison = _comparison(results)
    _print_report(results, comparison)
    if args.output_json:
        write_json(
            args.output_json,
            {
                "benchmark": "perplexity",
                "date": now_iso(),
                "model": model_name,
                "machine": machine_info(),
                "peak_rss_mib": peak_rss_mib(),
                "text": str(path),
                "text_tokens": len(token_ids),
                "context": args.context,
                "bos_token_id": bos,
                "engine_config": engine_config,
                "engine_dtype": engine_dtype,
                "systems": results,
                "comparison": comparison,
            },
        )
        print(f"\nWrote {args.output_json}")
    return 0


def _comparison(results: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    base = results.get(llamacpp.NAME)
    if base is None or "error" in base:
        return None
    ours, theirs = results["pagedllm"]["perplexity"], base["perplexity"]
    return {
        "relative_difference": (ours - theirs) / theirs,
        "scored_tokens_per_s_ratio": results["pagedllm"]["scored_tokens_per_s"] / base["scored_tokens_per_s"],
    }


def _print_report(results: dict[str, dict[str, Any]], comparison: dict[str, Any] | None) -> None:
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([f"{name} (failed)", None, None, None, None, None])
        else:
            ppl, nll = f"{r['perplexity']:.4f}", f"{r['mean_nll']:.5f}"
            rows.append([name, ppl, nll, r["elapsed_s"], r["scored_tokens_per_s"], r["cpu_cores_used"]])
    print()
    print(format_table(["system", "perplexity", "mean NLL", "time s", "scored tok/s", "CPU cores"], rows))
    for name, r in results.items():
        if "error" in r:
            print(f"\n{name} failed: {r['error']}")
    if comparison is not None:
        print(
            f"\npagedllm vs llama.cpp: perplexity {comparison['relative_difference']:+.4%} "
            f"(relative), scored tokens/s x{comparison['scored_tokens_per_s_ratio']:.2f}"
        )
