"""What the sections of a run share: the model shapes and sizes of a full and a tiny run, the run's
state (its options, the workload, the random-weight model and the engine started on it), its time
budget and its results file."""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm_bench.common import write_json
from pagedllm_bench.workloads import BenchRequest

SECTIONS = (
    "kernels",
    "equivalence",
    "throughput",
    "decode",
    "roofline",
    "serve",
    "hf",
    "serve_processes",
    "quantization",
    "swap",
)


@dataclass
class ModelShape:
    """A Qwen3-style decoder's shape (the random-weight throughput model)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int = 151936
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960


QWEN3_0_6B = ModelShape(1024, 28, 16, 8, 128, 3072)
TINY_QWEN3 = ModelShape(64, 2, 4, 2, 32, 128)
# The equivalence check's stand-in when the default model is not installed.
SMALL_QWEN3 = ModelShape(512, 4, 8, 4, 128, 1024)
# Weights ten times the usual initialisation scale give peaked next-token distributions, so that
# comparisons of greedy tokens are not dominated by near-ties.
SHARP_INIT = 0.2


@dataclass
class Settings:
    shape: ModelShape
    num_requests: int
    prompt_len: tuple[int, int]  # inclusive range
    output_len: tuple[int, int]
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    hf_requests: int
    hf_timeout_s: float
    serve_requests: int
    serve_max_output: int
    decode_running: int
    decode_prompt_len: int
    decode_steps: int
    equivalence_shape: ModelShape
    equivalence_prompts: int
    equivalence_tokens: int
    copy_bytes: int
    kernel_scale: str  # "full" or "tiny"


FULL = Settings(
    shape=QWEN3_0_6B,
    num_requests=256,
    prompt_len=(100, 1024),
    output_len=(100, 1024),
    max_model_len=2048,
    max_num_seqs=256,
    max_num_batched_tokens=8192,
    hf_requests=64,
    hf_timeout_s=150.0,
    serve_requests=256,
    serve_max_output=256,
    decode_running=256,
    decode_prompt_len=512,
    decode_steps=20,
    equivalence_shape=SMALL_QWEN3,
    equivalence_prompts=8,
    equivalence_tokens=32,
    copy_bytes=1 << 30,
    kernel_scale="full",
)
TINY = Settings(
    shape=TINY_QWEN3,
    num_requests=8,
    prompt_len=(8, 48),
    output_len=(4, 16),
    max_model_len=128,
    max_num_seqs=8,
    max_num_batched_tokens=256,
    hf_requests=4,
    hf_timeout_s=60.0,
    serve_requests=8,
    serve_max_output=16,
    decode_running=8,
    decode_prompt_len=16,
    decode_steps=3,
    equivalence_shape=TINY_QWEN3,
    equivalence_prompts=2,
    equivalence_tokens=6,
    copy_bytes=64 << 20,
    kernel_scale="tiny",
)


class Deadline:
    """The run's time budget."""

    def __init__(self, budget_s: float) -> None:
        self.start = time.perf_counter()
        self.budget_s = budget_s

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @property
    def remaining(self) -> float:
        return self.budget_s - self.elapsed


@dataclass
class RunState:
    """What the sections of one run share: the options and settings, the device and dtype, the
    workload, the random-weight model's directory and the engine started on it (``None`` until the
    ``throughput`` section starts it, and again once the ``hf`` section hands the device over)."""

    args: argparse.Namespace
    settings: Settings
    device: torch.device
    dtype_name: str
    requests: list[BenchRequest]
    deadline: Deadline
    model_dir: str | None = None
    llm: Any = None

    @property
    def dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype_name)
        return dtype


def write_results(path: str, name: str, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` and, when the environment variable ``OUT`` is set, to ``$OUT/name``
    (the folder a device machine sends back)."""
    write_json(path, data)
    out_dir = os.environ.get("OUT")
    if out_dir:
        write_json(os.path.join(out_dir, name), data)
