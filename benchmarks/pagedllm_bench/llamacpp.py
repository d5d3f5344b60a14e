"""llama.cpp baselines on a GGUF file, through llama-cpp-python's low-level API (``--baseline
llama.cpp-python``).

``--baseline llama.cpp`` names llama.cpp's own native tools (:mod:`pagedllm_bench.native`), which run
their own workloads: ``pagedllm bench scale`` and ``pagedllm bench serve --baseline llama-server``
compare with them; the commands here refuse that name and say so.

llama-cpp-python is a benchmark-only extra (``pip install 'pagedllm-bench[llamacpp]'``): it is imported on
first use, never by the engine or the tests. Everything runs on the CPU (no layer offloaded) with
``threads`` threads for both prompt processing and generation, the same count as the engine's torch
threads. Three measurements:

* :func:`measure_latency`: batch-1 prompt processing (the whole prompt in one ``llama_decode``, up to
  its first greedy token) and decoding (one token per ``llama_decode``, EOS ignored);
* :func:`run_batched`: many sequences decoded at once, one llama.cpp sequence id per request, as
  llama-server does: a request takes a free slot (at most ``max_num_seqs`` at once), its prompt is
  prefilled in chunks that share each ``llama_decode`` call with one token of every decoding sequence
  (at most ``max_batch_tokens`` tokens per call), it decodes greedily (argmax of its logits row)
  until its own output length, then leaves its slot (its KV cells are removed) to the next request;
* :func:`window_logits`: the logits of every position of a token window, for perplexity.

The KV cache is llama.cpp's default (float16, per-sequence streams: ``kv_unified`` off), sized so
that every slot holds its longest request.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedllm.model.loader import resolve_model_path
from pagedllm_bench.baselines import BASELINES, BaselineResult
from pagedllm_bench.workloads import BenchRequest

logger = logging.getLogger("pagedllm_bench")

NAME = "llama.cpp-python"
# The native tools' name, refused by the commands that run llama.cpp through the binding.
NATIVE_NAME = "llama.cpp"
INSTALL_HINT = "install the llamacpp extra: pip install 'pagedllm-bench[llamacpp]'"
# llama.cpp's LLAMA_MAX_SEQ: the most sequence ids a context may have.
MAX_SEQUENCES = 256
# llama.cpp's default physical batch (n_ubatch) and logical batch (n_batch).
DEFAULT_UBATCH = 512
DEFAULT_BATCH = 2048
# llama.cpp rounds a context's cells (and each sequence's share) up to a multiple of this.
KV_PAD = 256


def import_llama_cpp() -> Any:
    """The ``llama_cpp`` module; RuntimeError naming the extra to install when it is absent."""
    try:
        return importlib.import_module("llama_cpp")
    except ImportError as exc:
        raise RuntimeError(f"the llama.cpp baseline needs llama-cpp-python; {INSTALL_HINT}") from exc


def gguf_path(model: str | None, baseline: str = NAME) -> str:
    """The GGUF file of a pagedllm model argument; ValueError when the model is not a GGUF file."""
    kind, path = resolve_model_path(model)
    if kind != "gguf":
        raise ValueError(
            f"--baseline {baseline} needs a GGUF model file, and {path} is a Hugging Face checkpoint "
            "directory; pass --model FILE.gguf."
        )
    return path


def native_refusal(command: str) -> str:
    """Why ``pagedllm bench <command> --baseline llama.cpp`` is refused, and what to run instead."""
    return (
        f"--baseline {NATIVE_NAME} means llama.cpp's native tools, which run their own workloads: compare "
        "with them through 'pagedllm bench scale --model FILE.gguf' (or 'pagedllm bench serve --baseline "
        f"llama-server'); 'pagedllm bench {command}' runs llama.cpp on its own workload through the Python "
        f"binding: --baseline {NAME}."
    )


def split_baselines(text: str | None) -> tuple[str | None, bool]:
    """Take ``llama.cpp-python`` out of ``pagedllm bench throughput``'s ``--baseline`` list: (the other names,
    comma-separated, for :func:`pagedllm_bench.baselines.parse_baselines`; whether it was named).
    ValueError names an unknown entry."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    if NATIVE_NAME in names:
        raise ValueError(native_refusal("throughput"))
    choices = (*BASELINES, NAME)
    unknown = [n for n in names if n not in choices]
    if unknown:
        raise ValueError(f"unknown baseline(s) {', '.join(unknown)}; choose from {', '.join(choices)}.")
    others = [n for n in names if n != NAME]
    return ",".join(others) or None, NAME in names


def check_baseline(model: str | None, temperature: float = 0.0) -> str:
    """Validate ``--baseline llama.cpp-python`` before any long run: the model's GGUF path, or ValueError
    (the model is not a GGUF file, sampling is not greedy, or llama-cpp-python is not installed)."""
    if temperature > 0:
        raise ValueError("the llama.cpp baseline decodes greedily; run it with --temperature 0.")
    path = gguf_path(model)
    try:
        import_llama_cpp()
    except RuntimeError as exc:
        raise ValueError(str(exc)) from None
    return path


def set_log_level(level: str) -> None:
    """Show llama.cpp's own log (model and context details) only at the ``debug`` and ``info``
    levels; llama-cpp-python prints all of it otherwise."""
    quiet = level.lower() not in ("debug", "info")
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR if quiet else logging.DEBUG)


class LlamaCppModel:
    """A GGUF file loaded by llama.cpp on the CPU (memory-mapped), for :class:`LlamaCppContext`."""

    def __init__(self, path: str, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}.")
        self.lib = import_llama_cpp()
        lib = self.lib
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        self.model = lib.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}.")
        self.path = path
        self.threads = threads
        vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = int(lib.llama_vocab_n_tokens(vocab))
        self.add_bos = bool(lib.llama_vocab_get_add_bos(vocab))
        self.bos_token_id = int(lib.llama_vocab_bos(vocab))

    def system_info(self) -> str:
        """llama.cpp's build features (``AVX512 = 1 | ...``), as ``llama_print_system_info`` says."""
        return bytes(self.lib.llama_print_system_info()).decode(errors="replace").strip()

    def context(
        self, n_ctx: int, n_batch: int, n_seq_max: int = 1, n_outputs_max: int = 0
    ) -> LlamaCppContext:
        """A new context (KV cache) of ``n_ctx`` cells shared by ``n_seq_max`` sequences, taking
        ``n_batch`` tokens per ``llama_decode`` (computed in llama.cpp's default physical batches of
        512) and giving at most ``n_outputs_max`` logits rows per call (0: ``n_batch``)."""
        return LlamaCppContext(self, n_ctx, n_batch, n_seq_max, n_outputs_max)

    def close(self) -> None:
        if self.model:
            self.lib.llama_model_free(self.model)
            self.model = None

    def __enter__(self) -> LlamaCppModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LlamaCppContext:
    """A llama.cpp context with one reusable ``llama_batch`` of ``n_batch`` tokens."""

    def __init__(
        self, model: LlamaCppModel, n_ctx: int, n_batch: int, n_seq_max: int, n_outputs_max: int
    ) -> None:
        if not 1 <= n_seq_max <= MAX_SEQUENCES:
            raise ValueError(f"llama.cpp takes 1 to {MAX_SEQUENCES} sequences, got {n_seq_max}.")
        lib = model.lib
        self.lib = lib
        self.n_vocab = model.n_vocab
        params = lib.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = min(DEFAULT_UBATCH, n_batch)
        params.n_seq_max = n_seq_max
        params.n_outputs_max = n_outputs_max
        params.n_threads = model.threads
        params.n_threads_batch = model.threads
        params.no_perf = True
        self.ctx = lib.llama_init_from_model(model.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {n_ctx} cells.")
        self.n_ctx = int(lib.llama_n_ctx(self.ctx))
        self.n_batch = int(lib.llama_n_batch(self.ctx))
        self.memory = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(self.n_batch, 0, 1)
        cap = self.n_batch
        self._token = np.ctypeslib.as_array(self.batch.token, shape=(cap,))
        self._pos = np.ctypeslib.as_array(self.batch.pos, shape=(cap,))
        self._n_seq_id = np.ctypeslib.as_array(self.batch.n_seq_id, shape=(cap,))
        self._logits = np.ctypeslib.as_array(self.batch.logits, shape=(cap,))
        self._n_seq_id[:] = 1
        self._seq_of_row = [-1] * cap

    def decode(
        self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int], outputs: Sequence[bool]
    ) -> np.ndarray:
        """One ``llama_decode`` of these tokens; returns the float32 logits of the rows whose
        ``outputs`` flag is set, in batch order, shape (rows, n_vocab) (a view, valid until the next
        call)."""
        n = len(tokens)
        if not 0 < n <= self.n_batch:
            raise ValueError(f"a batch holds 1 to {self.n_batch} tokens, got {n}.")
        self._token[:n] = tokens
        self._pos[:n] = positions
        self._logits[:n] = outputs
        seq_id = self.batch.seq_id
        for i, s in enumerate(seq_ids):
            if self._seq_of_row[i] != s:
                seq_id[i][0] = s
                self._seq_of_row[i] = s
        self.batch.n_tokens = n
        rc = self.lib.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with status {rc} on a batch of {n} tokens.")
        n_out = int(np.count_nonzero(self._logits[:n]))
        if n_out == 0:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        ptr = self.lib.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(
            ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_out, self.n_vocab)
        )

    def clear(self) -> None:
        """Empty the KV cache."""
        self.lib.llama_memory_clear(self.memory, True)

    def remove_sequence(self, seq_id: int) -> None:
        """Free the KV cells of one sequence."""
        self.lib.llama_memory_seq_rm(self.memory, seq_id, -1, -1)

    def close(self) -> None:
        if self.ctx:
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.ctx = None

    def __enter__(self) -> LlamaCppContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- batch-1 latency ---------------------------------------------------------------------------------


@dataclass
class LatencySample:
    """One batch-1 run: seconds to the first token (prompt processing), seconds from the first token to
    the last (decoding), and the tokens generated."""

    prompt_len: int
    prompt_s: float
    decode_s: float
    output_tokens: list[int]

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prompt_len / max(self.prompt_s, 1e-12)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first per second of decoding (NaN with a single output token)."""
        n = len(self.output_tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else float("nan")


def latency_context(model: LlamaCppModel, prompt_len: int, output_len: int) -> LlamaCppContext:
    """A one-sequence context that holds the prompt and output and takes the prompt in one call."""
    n_batch = max(DEFAULT_BATCH, prompt_len)
    return model.context(prompt_len + output_len, n_batch, n_outputs_max=1)


def measure_latency(ctx: LlamaCppContext, prompt: Sequence[int], output_len: int) -> LatencySample:
    """Greedy batch-1 generation of ``output_len`` tokens after ``prompt`` (EOS ignored), timed in
    two parts: prompt processing to the first token, then the remaining tokens one per call."""
    if output_len < 1 or not prompt:
        raise ValueError("need a non-empty prompt and at least one output token.")
    n = len(prompt)
    ctx.clear()
    start = time.perf_counter()
    logits = ctx.decode(prompt, range(n), [0] * n, [False] * (n - 1) + [True])
    token = int(np.argmax(logits[0]))
    first = time.perf_counter()
    tokens = [token]
    for pos in range(n, n + output_len - 1):
        logits = ctx.decode([token], [pos], [0], [True])
        token = int(np.argmax(logits[0]))
        tokens.append(token)
    last = time.perf_counter()
    return LatencySample(n, first - start, last - first, tokens)


# -- batched decoding --------------------------------------------------------------------------------


@dataclass
class _Slot:
    """A request occupying one sequence id."""

    index: int  # the request's index in the workload
    request: BenchRequest
    prefilled: int = 0  # prompt tokens already decoded
    output: list[int] = field(default_factory=list)


@dataclass
class BatchedRun:
    """What :func:`run_batched` produced: each request's output tokens (workload order) and the time."""

    outputs: list[list[int]]
    elapsed_s: float
    num_decode_calls: int
    n_slots: int
    n_ctx: int
    n_batch: int


def batched_context(
    model: LlamaCppModel, requests: Sequence[BenchRequest], max_num_seqs: int, max_batch_tokens: int
) -> LlamaCppContext:
    """A context with one sequence slot per request that may run at once (at most ``max_num_seqs``),
    each with room for the longest request, and ``llama_decode`` calls of ``max_batch_tokens``."""
    if not requests:
        raise ValueError("no requests.")
    n_slots = min(max_num_seqs, len(requests), MAX_SEQUENCES)
    longest = max(r.prompt_len + r.output_len for r in requests)
    per_seq = -(-longest // KV_PAD) * KV_PAD  # llama.cpp pads each sequence's cells to 256
    n_batch = max(max_batch_tokens, n_slots)
    return model.context(n_slots * per_seq, n_batch, n_seq_max=n_slots, n_outputs_max=n_slots)


def run_batched(
    ctx: LlamaCppContext,
    requests: Sequence[BenchRequest],
    max_num_seqs: int,
    max_batch_tokens: int | None = None,
    eos_token_ids: Sequence[int] | None = None,
) -> BatchedRun:
    """Decode every request greedily, many at once (see the module docstring), in ``ctx`` (from
    :func:`batched_context`; emptied first).

    Each ``llama_decode`` call holds one token of every decoding sequence, then prompt chunks of the
    sequences still prefilling (oldest first) up to ``max_batch_tokens`` (default: the context's
    ``n_batch``). A request stops at its output length, or at a token of ``eos_token_ids`` when given.
    """
    n_slots = min(max_num_seqs, len(requests), int(ctx.lib.llama_n_seq_max(ctx.ctx)))
    budget = min(max_batch_tokens or ctx.n_batch, ctx.n_batch)
    if budget < n_slots:
        raise ValueError(f"a batch of {budget} tokens cannot hold one token of each of {n_slots} sequences.")
    stop = set(eos_token_ids or ())
    ctx.clear()
    queue = deque(enumerate(requests))
    free = list(range(n_slots - 1, -1, -1))
    active: dict[int, _Slot] = {}  # sequence id -> slot, in admission order
    outputs: list[list[int]] = [[] for _ in requests]
    calls = 0
    start = time.perf_counter()
    while queue or active:
        while queue and free:
            index, req = queue.popleft()
            active[free.pop()] = _Slot(index, req)
        tokens: list[int] = []
        positions: list[int] = []
        seqs: list[int] = []
        flags: list[bool] = []
        sampled: list[int] = []  # sequence ids whose row gives a token, in batch order
        for seq, slot in active.items():
            if slot.prefilled == slot.request.prompt_len:
                tokens.append(slot.output[-1])
                positions.append(slot.request.prompt_len + len(slot.output) - 1)
                seqs.append(seq)
                flags.append(True)
                sampled.append(seq)
        room = budget - len(tokens)
        for seq, slot in active.items():
            remaining = slot.request.prompt_len - slot.prefilled
            if remaining == 0 or room == 0:
                continue
            take = min(remaining, room)
            lo = slot.prefilled
            tokens.extend(slot.request.prompt_token_ids[lo : lo + take])
            positions.extend(range(lo, lo + take))
            seqs.extend([seq] * take)
            done = take == remaining
            flags.extend([False] * (take - 1) + [done])
            if done:
                sampled.append(seq)
            slot.prefilled += take
            room -= take
        logits = ctx.decode(tokens, positions, seqs, flags)
        calls += 1
        # Outputs come in batch order: decode rows first, then completed prompts in admission order,
        # which is the order of ``sampled``.
        next_tokens = np.argmax(logits, axis=1).tolist() if len(sampled) else []
        for seq, token in zip(sampled, next_tokens, strict=True):
            slot = active[seq]
            slot.output.append(int(token))
            if len(slot.output) >= slot.request.output_len or token in stop:
                outputs[slot.index] = slot.output
                del active[seq]
                ctx.remove_sequence(seq)
                free.append(seq)
    elapsed = time.perf_counter() - start
    return BatchedRun(outputs, elapsed, calls, n_slots, ctx.n_ctx, budget)


def throughput_baseline(
    path: str,
    requests: Sequence[BenchRequest],
    max_num_seqs: int,
    max_batch_tokens: int,
    eos_token_ids: Sequence[int] | None = None,
    warmup: bool = True,
    log_level: str = "warning",
    threads: int | None = None,
) -> dict[str, Any]:
    """``pagedllm bench throughput``'s llama.cpp baseline on exactly the benchmark's workload: a
    :class:`~pagedllm_bench.baselines.BaselineResult` as a dict, or ``{"name", "error"}``.

    ``threads`` defaults to torch's thread count (the engine's); requests stop at a token of
    ``eos_token_ids`` when given (None: EOS ignored). Model loading, context creation and a short
    warm-up are outside the timed region, as for the engine; decoding is greedy.
    """
    threads = threads or torch.get_num_threads()
    set_log_level(log_level)
    try:
        with LlamaCppModel(path, threads) as model:
            with batched_context(model, requests, max_num_seqs, max_batch_tokens) as ctx:
                if warmup:
                    run_batched(ctx, [BenchRequest(list(requests[0].prompt_token_ids[:16]), 4)], 1)
                cpu = time.process_time()
                run = run_batched(ctx, requests, max_num_seqs, max_batch_tokens, eos_token_ids)
                cpu = time.process_time() - cpu
                system_info = model.system_info()
    except (RuntimeError, ValueError, MemoryError) as exc:
        logger.error("Baseline %s failed: %s", NAME, exc)
        return {"name": NAME, "error": str(exc)}
    output_tokens = sum(len(o) for o in run.outputs)
    result = BaselineResult(
        name=NAME,
        elapsed_s=run.elapsed_s,
        num_requests=len(requests),
        prompt_tokens=sum(r.prompt_len for r in requests),
        output_tokens=output_tokens,
        computed_output_tokens=output_tokens,
        details={
            "gguf": path,
            "threads": threads,
            "sampling": "greedy",
            "max_num_seqs": run.n_slots,
            "n_ctx": run.n_ctx,
            "max_batch_tokens": run.n_batch,
            "decode_calls": run.num_decode_calls,
            # CPU seconds of the process per second: well below ``threads`` when other processes ran.
            "cpu_cores_used": cpu / max(run.elapsed_s, 1e-9),
            "system_info": system_info,
        },
    )
    return result.as_dict()


# -- perplexity ----------------------------------------------------------------------------------------


def perplexity_context(model: LlamaCppModel, window_len: int) -> LlamaCppContext:
    """A one-sequence context that takes a whole window in one call with logits at every position."""
    return model.context(window_len, window_len)


def window_logits(ctx: LlamaCppContext, window: Sequence[int]) -> np.ndarray:
    """The float32 logits of every position of ``window`` (decoded alone, from an empty cache), a copy
    of shape (len(window), n_vocab)."""
    ctx.clear()
    n = len(window)
    return np.array(ctx.decode(window, range(n), [0] * n, [True] * n))
