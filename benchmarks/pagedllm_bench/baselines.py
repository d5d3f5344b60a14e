"""Hugging Face transformers baselines run on exactly the benchmark's workload.

* ``hf-static``: ``model.generate`` on padded static batches of ``batch_size`` requests, in workload
  order. Prompts are left-padded with an attention mask; every row of a batch generates the batch's
  largest output length (a static batch cannot retire rows early), but only each request's own
  requested output tokens are counted.
* ``hf-cb``: transformers' own continuous batching (the manager behind ``model.generate_batch``), with
  each request's own ``max_new_tokens`` and EOS disabled when EOS is ignored. ``generate_batch`` itself
  takes a single ``max_new_tokens`` for the whole batch, so the manager it wraps
  (``continuous_batching_context_manager`` + ``add_request``) is used directly to give each request its
  own length; model loading, KV cache allocation and warm-up are outside the timed region, as for the
  engine. On CPU its cache sizing needs ``psutil`` (it reads the host's memory through it).

Both run the model in float32 on the engine's device (CPU unless the engine runs on a GPU). The
pieces of ``hf-cb`` (:func:`cb_config`, :func:`run_continuous_batching`) also serve the GPU script's
comparison with transformers, which loads the model in another dtype (:func:`load_hf_model`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.model.loader import resolve_model_path
from pagedllm_bench.common import synchronize
from pagedllm_bench.workloads import BenchRequest

logger = logging.getLogger("pagedllm_bench")

BASELINES = ("hf-static", "hf-cb")


@dataclass
class BaselineResult:
    """Timing of one baseline on the workload.

    ``output_tokens`` counts only the tokens the requests asked for (up to EOS when EOS is honoured);
    ``computed_output_tokens`` is what the baseline actually generated, padding rows included.
    """

    name: str
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    computed_output_tokens: int
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        elapsed = max(self.elapsed_s, 1e-9)
        return {
            "name": self.name,
            "elapsed_s": self.elapsed_s,
            "num_requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "computed_output_tokens": self.computed_output_tokens,
            "requests_per_s": self.num_requests / elapsed,
            "output_tokens_per_s": self.output_tokens / elapsed,
            "total_tokens_per_s": (self.prompt_tokens + self.output_tokens) / elapsed,
            **self.details,
        }


def parse_baselines(text: str | None) -> list[str]:
    """``"hf-static,hf-cb"`` -> ``["hf-static", "hf-cb"]``; raises ValueError naming unknown entries."""
    if not text:
        return []
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BASELINES]
    if unknown:
        raise ValueError(f"unknown baseline(s) {', '.join(unknown)}; choose from {', '.join(BASELINES)}.")
    return list(dict.fromkeys(names))


def hf_dtype(dtype: torch.dtype) -> dict[str, Any]:
    """The dtype keyword of transformers' model constructors (``torch_dtype`` before 4.56)."""
    import transformers
    from packaging.version import Version

    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return {key: dtype}


def load_hf_model(
    model: str | None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    **kwargs: Any,
) -> Any:
    """The Hugging Face model for a pagedllm model argument, in ``dtype`` on ``device``, in eval mode.

    A GGUF file (the default model included) is loaded with transformers' own GGUF support;
    ``kwargs`` (e.g. ``attn_implementation``) go to ``from_pretrained``.
    """
    from transformers import AutoModelForCausalLM

    kind, path = resolve_model_path(model)
    hf: Any
    if kind == "gguf":
        hf = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), **hf_dtype(dtype), **kwargs
        )
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, **hf_dtype(dtype), **kwargs)
    return hf.to(device).eval()


def _count_output(tokens: list[int], requested: int, eos_ids: set[int], ignore_eos: bool) -> int:
    """Tokens a request would have received: its requested length, or up to and including EOS."""
    tokens = tokens[:requested]
    if not ignore_eos:
        for i, t in enumerate(tokens):
            if t in eos_ids:
                return i + 1
    return len(tokens)


def generation_config(
    max_new_tokens: int,
    temperature: float,
    eos_token_ids: list[int],
    pad_token_id: int,
    ignore_eos: bool,
    *,
    min_new_tokens: int | None = None,
    **extra: Any,
) -> Any:
    """transformers' ``GenerationConfig``: sampling at ``temperature`` over the whole vocabulary
    (greedy at 0), EOS disabled when ignored; ``extra`` fields are passed on."""
    from transformers import GenerationConfig

    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        eos_token_id=-1 if ignore_eos and min_new_tokens is None else list(eos_token_ids),
        pad_token_id=pad_token_id,
        **sampling,
        **extra,
    )


@torch.inference_mode()
def run_hf_static(
    model: Any,
    requests: list[BenchRequest],
    batch_size: int,
    *,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    eos_token_ids: list[int] | None = None,
    pad_token_id: int = 0,
    seed: int = 0,
    warmup: bool = True,
) -> BaselineResult:
    """Padded static batches through ``model.generate`` (see the module docstring)."""
    if batch_size < 1:
        raise ValueError(f"--baseline-batch-size must be at least 1, got {batch_size}.")
    eos = list(eos_token_ids or [])
    if warmup:
        _static_batch(model, [BenchRequest([1, 2, 3, 4], 2)], temperature, ignore_eos, eos, pad_token_id)
    torch.manual_seed(seed)
    counted = computed = padding = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        generated, pad = _static_batch(model, batch, temperature, ignore_eos, eos, pad_token_id)
        padding += pad
        for req, tokens in zip(batch, generated, strict=True):
            computed += len(tokens)
            counted += _count_output(tokens, req.output_len, set(eos), ignore_eos)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(r.prompt_len for r in requests)
    return BaselineResult(
        name="hf-static",
        elapsed_s=elapsed,
        num_requests=len(requests),
        prompt_tokens=prompt_tokens,
        output_tokens=counted,
        computed_output_tokens=computed,
        details={
            "batch_size": batch_size,
            "num_batches": math.ceil(len(requests) / batch_size),
            "prompt_padding_tokens": padding,
        },
    )


def _static_batch(
    model: Any,
    batch: list[BenchRequest],
    temperature: float,
    ignore_eos: bool,
    eos: list[int],
    pad_token_id: int,
) -> tuple[list[list[int]], int]:
    """Generate one left-padded batch; returns each row's new tokens and the number of pad tokens."""
    width = max(r.prompt_len for r in batch)
    max_new = max(r.output_len for r in batch)
    input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, req in enumerate(batch):
        input_ids[row, width - req.prompt_len :] = torch.tensor(req.prompt_token_ids, dtype=torch.long)
        mask[row, width - req.prompt_len :] = 1
    config = generation_config(
        max_new,
        temperature,
        eos,
        pad_token_id,
        ignore_eos,
        # Suppressing EOS until max_new_tokens is how generate() ignores it for every row.
        min_new_tokens=max_new if ignore_eos else None,
    )
    out = model.generate(
        input_ids=input_ids.to(model.device), attention_mask=mask.to(model.device), generation_config=config
    )
    new = out[:, width:].tolist()
    padding = int(len(batch) * width - mask.sum().item())
    return [list(map(int, row)) for row in new], padding


def has_cb_manager() -> bool:
    """Whether transformers has the continuous batching manager used directly here (transformers 5)."""
    try:
        from transformers import ContinuousBatchingConfig  # noqa: F401
        from transformers.generation.continuous_batching.utils import WorkloadHints  # noqa: F401
    except ImportError:
        return False
    return True


CB_PAGE_SIZE = 256


def cb_config(
    requests: list[BenchRequest],
    max_batch_tokens: int | None,
    seed: int,
    max_requests_per_batch: int | None = None,
) -> Any:
    """transformers' ``ContinuousBatchingConfig`` with a KV cache that holds every request at once.

    The field names moved between transformers 5 releases (``block_size`` became ``page_size``;
    ``seed`` and ``auto_switch_to_flash`` came later): those the installed version has are passed.
    Switching to flash attention is allowed only where the flash-attn package is installed (without
    it, transformers would try to fetch kernels from the Hub).
    """
    from transformers import ContinuousBatchingConfig

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    pages = sum(math.ceil((r.prompt_len + r.output_len) / CB_PAGE_SIZE) for r in requests) + 1
    wanted: dict[str, Any] = {
        "page_size" if "page_size" in fields else "block_size": CB_PAGE_SIZE,
        "num_blocks": pages,
        "max_batch_tokens": max_batch_tokens,
        "seed": seed,
        "auto_switch_to_flash": importlib.util.find_spec("flash_attn") is not None,
    }
    if max_requests_per_batch is not None:
        wanted["max_requests_per_batch"] = max_requests_per_batch
    return ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in fields})


@dataclass
class CBRun:
    """What :func:`run_continuous_batching` saw: the finished results by request id (``bench-<i>``)."""

    request_ids: list[str]
    results: dict[str, Any]
    elapsed_s: float
    startup_s: float
    timed_out: bool
    config: Any  # the manager's resolved ContinuousBatchingConfig


def run_continuous_batching(
    model: Any,
    requests: list[BenchRequest],
    gen_config: Any,
    continuous_batching_config: Any,
    *,
    eos_token_id: int | list[int] = -1,
    timeout_s: float = 3600.0,
    device: torch.device | None = None,
) -> CBRun:
    """The requests through transformers' continuous batching manager (the one behind
    ``generate_batch``), each with its own ``max_new_tokens``; the timed region starts when the
    manager is up (the device synchronised on a GPU) and ends when every request has finished or
    ``timeout_s`` has passed (then only the finished ones are in the results)."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    hints = WorkloadHints(
        max_prompt_length=max(r.prompt_len for r in requests),
        max_generated_length=max(r.output_len for r in requests),
        num_requests=len(requests),
    )
    results: dict[str, Any] = {}
    timed_out = False
    t0 = time.perf_counter()
    try:
        with model.continuous_batching_context_manager(
            generation_config=gen_config,
            continuous_batching_config=continuous_batching_config,
            workload_hints=hints,
            block=True,
            timeout=30,
        ) as manager:
            startup_s = time.perf_counter() - t0
            synchronize(device)
            start = time.perf_counter()
            ids = []
            for i, req in enumerate(requests):
                rid = manager.add_request(
                    list(req.prompt_token_ids),
                    request_id=f"bench-{i}",
                    max_new_tokens=req.output_len,
                    eos_token_id=eos_token_id,
                )
                if rid is None:
                    raise RuntimeError("transformers' continuous batching manager refused a request.")
                ids.append(rid)
            deadline = start + timeout_s
            while len(results) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError(
                        f"transformers' continuous batching stopped with {len(ids) - len(results)} "
                        "requests unfinished (see its log above)."
                    )
                if time.perf_counter() > deadline:
                    timed_out = True
                    break
            synchronize(device)
            elapsed = time.perf_counter() - start
            resolved = manager.continuous_batching_config
    finally:
        destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
        if destroy is not None:
            destroy()
    return CBRun(ids, results, elapsed, startup_s, timed_out, resolved)


@torch.inference_mode()
def run_hf_cb(
    model: Any,
    requests: list[BenchRequest],
    *,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    eos_token_ids: list[int] | None = None,
    pad_token_id: int = 0,
    seed: int = 0,
    max_batch_tokens: int | None = None,
    timeout_s: float = 3600.0,
) -> BaselineResult:
    """transformers continuous batching with per-request output lengths (see the module docstring).

    The KV cache is sized to hold every request at once (so the baseline never has to evict), and
    ``max_batch_tokens`` bounds the tokens of one forward pass like the engine's
    ``max_num_batched_tokens``.
    """
    if not has_cb_manager():  # pragma: no cover - depends on the transformers version
        raise RuntimeError(
            "hf-cb needs transformers' continuous batching API (transformers >= 5), which this "
            "installation lacks."
        )
    try:
        import psutil  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            "hf-cb on CPU needs psutil: transformers sizes its continuous-batching cache from the host "
            "memory reported by psutil and refuses to allocate it otherwise (pip install psutil)."
        ) from exc

    eos = list(eos_token_ids or [])
    config = cb_config(requests, max_batch_tokens, seed, max_requests_per_batch=len(requests))
    gen_config = generation_config(
        max(r.output_len for r in requests), temperature, eos, pad_token_id, ignore_eos
    )
    torch.manual_seed(seed)
    run = run_continuous_batching(
        model, requests, gen_config, config, eos_token_id=-1 if ignore_eos else eos, timeout_s=timeout_s
    )
    if run.timed_out:
        raise RuntimeError(f"hf-cb did not finish within {timeout_s:.0f}s.")
    results = run.results
    failed = [r.request_id for r in results.values() if r.error is not None]
    if failed:
        first = results[failed[0]].error
        raise RuntimeError(f"hf-cb: {len(failed)} requests failed; the first error: {first}")
    counted = computed = 0
    for rid, req in zip(run.request_ids, requests, strict=True):
        tokens = list(results[rid].generated_tokens)
        computed += len(tokens)
        counted += _count_output(tokens, req.output_len, set(eos), ignore_eos)
    resolved = run.config
    return BaselineResult(
        name="hf-cb",
        elapsed_s=run.elapsed_s,
        num_requests=len(requests),
        prompt_tokens=sum(r.prompt_len for r in requests),
        output_tokens=counted,
        computed_output_tokens=computed,
        details={
            "attn_implementation": str(model.config._attn_implementation),
            "page_size": CB_PAGE_SIZE,
            "num_blocks": config.num_blocks,
            "max_batch_tokens": getattr(resolved, "max_batch_tokens", max_batch_tokens),
            "max_requests_per_batch": getattr(resolved, "max_requests_per_batch", None),
        },
    )
