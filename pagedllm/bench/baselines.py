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

Both run the model in float32 on the engine's device (CPU unless the engine runs on a GPU).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.bench.workloads import BenchRequest
from pagedllm.model.loader import resolve_model_path

logger = logging.getLogger("pagedllm.bench")

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


def load_hf_model(model: str | None, device: str = "cpu") -> Any:
    """The Hugging Face model for a pagedllm model argument, in float32 on ``device``, in eval mode.

    A GGUF file (the default model included) is loaded with transformers' own GGUF support.
    """
    from transformers import AutoModelForCausalLM

    kind, path = resolve_model_path(model)
    hf: Any
    if kind == "gguf":
        hf = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
        )
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return hf.to(device).eval()


def _count_output(tokens: list[int], requested: int, eos_ids: set[int], ignore_eos: bool) -> int:
    """Tokens a request would have received: its requested length, or up to and including EOS."""
    tokens = tokens[:requested]
    if not ignore_eos:
        for i, t in enumerate(tokens):
            if t in eos_ids:
                return i + 1
    return len(tokens)


def _generation_config(
    max_new_tokens: int,
    temperature: float,
    eos_token_ids: list[int],
    pad_token_id: int,
    ignore_eos: bool,
    *,
    min_new_tokens: int | None = None,
) -> Any:
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
    config = _generation_config(
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
    try:
        from transformers import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError as exc:  # pragma: no cover - depends on the transformers version
        raise RuntimeError(
            f"hf-cb needs transformers' continuous batching API (transformers >= 5), which this "
            f"installation lacks: {exc}"
        ) from exc
    try:
        import psutil  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            "hf-cb on CPU needs psutil: transformers sizes its continuous-batching cache from the host "
            "memory reported by psutil and refuses to allocate it otherwise (pip install psutil)."
        ) from exc

    eos = list(eos_token_ids or [])
    max_out = max(r.output_len for r in requests)
    max_prompt = max(r.prompt_len for r in requests)
    page_size = 256
    pages = sum(math.ceil((r.prompt_len + r.output_len) / page_size) for r in requests) + 1
    cb_config = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=pages,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=len(requests),
        seed=seed,
    )
    hints = WorkloadHints(
        max_prompt_length=max_prompt, max_generated_length=max_out, num_requests=len(requests)
    )
    gen_config = _generation_config(max_out, temperature, eos, pad_token_id, ignore_eos)
    torch.manual_seed(seed)
    results: dict[str, Any] = {}
    try:
        with model.continuous_batching_context_manager(
            generation_config=gen_config,
            continuous_batching_config=cb_config,
            workload_hints=hints,
            block=True,
            timeout=30,
        ) as manager:
            start = time.perf_counter()
            ids = []
            for i, req in enumerate(requests):
                rid = manager.add_request(
                    list(req.prompt_token_ids),
                    request_id=f"bench-{i}",
                    max_new_tokens=req.output_len,
                    eos_token_id=-1 if ignore_eos else eos,
                )
                if rid is None:
                    raise RuntimeError("transformers' continuous batching manager refused a request.")
                ids.append(rid)
            deadline = time.monotonic() + timeout_s
            while len(results) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError(
                        f"transformers' continuous batching stopped with {len(ids) - len(results)} "
                        "requests unfinished (see its log above)."
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(f"hf-cb did not finish within {timeout_s:.0f}s.")
            elapsed = time.perf_counter() - start
            resolved = manager.continuous_batching_config
    finally:
        destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
        if destroy is not None:
            destroy()
    failed = [r.request_id for r in results.values() if r.error is not None]
    if failed:
        first = results[failed[0]].error
        raise RuntimeError(f"hf-cb: {len(failed)} requests failed; the first error: {first}")
    counted = computed = 0
    for i, req in enumerate(requests):
        tokens = list(results[f"bench-{i}"].generated_tokens)
        computed += len(tokens)
        counted += _count_output(tokens, req.output_len, set(eos), ignore_eos)
    return BaselineResult(
        name="hf-cb",
        elapsed_s=elapsed,
        num_requests=len(requests),
        prompt_tokens=sum(r.prompt_len for r in requests),
        output_tokens=counted,
        computed_output_tokens=computed,
        details={
            "attn_implementation": str(model.config._attn_implementation),
            "page_size": page_size,
            "num_blocks": pages,
            "max_batch_tokens": getattr(resolved, "max_batch_tokens", max_batch_tokens),
            "max_requests_per_batch": getattr(resolved, "max_requests_per_batch", None),
        },
    )
