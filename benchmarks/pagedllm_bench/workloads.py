"""Benchmark workloads: lists of (prompt token ids, output length) requests.

* ``random``: prompts of random token ids, lengths drawn uniformly from ``--input-len MIN:MAX``, output
  lengths from ``--output-len MIN:MAX``;
* ``prefix``: every prompt is one shared random "system prompt" of ``--prefix-len`` tokens followed by
  a short distinct random suffix (``--suffix-len``);
* ``--dataset FILE.jsonl``: one JSON object per line, ``{"prompt": "text" | [token ids], "output_len": N}``
  (``output_len`` optional: drawn from ``--output-len`` when absent).

Every workload is a deterministic function of its arguments and ``--seed`` (the engine's seed flag,
which seeds the workload too).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class BenchRequest:
    """One benchmark request: its prompt as token ids and how many tokens it asks for."""

    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Workload:
    """A named list of requests and the parameters that generated it (recorded in the JSON results)."""

    name: str
    requests: list[BenchRequest]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    @property
    def max_total_len(self) -> int:
        return max((r.prompt_len + r.output_len for r in self.requests), default=0)

    def summary(self) -> dict[str, Any]:
        """Sizes of the workload: request count, prompt/output token totals and length ranges."""
        prompt_lens = [r.prompt_len for r in self.requests]
        output_lens = [r.output_len for r in self.requests]
        return {
            "name": self.name,
            "num_requests": len(self.requests),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "prompt_len_min": min(prompt_lens, default=0),
            "prompt_len_max": max(prompt_lens, default=0),
            "output_len_min": min(output_lens, default=0),
            "output_len_max": max(output_lens, default=0),
            **self.params,
        }


def parse_range(text: str) -> tuple[int, int]:
    """Parse ``"N"`` or ``"MIN:MAX"`` into an inclusive ``(min, max)`` range of positive integers."""
    parts = text.split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {text!r}") from None
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def random_ids(rng: random.Random, n: int, vocab: Sequence[int]) -> list[int]:
    return [vocab[rng.randrange(len(vocab))] for _ in range(n)]


def token_pool(vocab_size: int, exclude: Iterable[int]) -> list[int]:
    excluded = set(exclude)
    pool = [t for t in range(vocab_size) if t not in excluded]
    if not pool:
        raise ValueError("no token ids left to build random prompts from.")
    return pool


def random_workload(
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
    exclude_token_ids: Iterable[int] = (),
) -> Workload:
    """Prompts of uniformly random token ids (``exclude_token_ids``, e.g. EOS/BOS, never appear)."""
    rng = random.Random(seed)
    pool = token_pool(vocab_size, exclude_token_ids)
    requests = []
    for _ in range(num_prompts):
        n_in = rng.randint(*input_len)
        n_out = rng.randint(*output_len)
        requests.append(BenchRequest(random_ids(rng, n_in, pool), n_out))
    return Workload(
        "random",
        requests,
        {"input_len": list(input_len), "output_len": list(output_len), "seed": seed},
    )


def prefix_workload(
    num_prompts: int,
    prefix_len: int,
    suffix_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
    exclude_token_ids: Iterable[int] = (),
) -> Workload:
    """Requests sharing one random ``prefix_len``-token prompt, each with its own random suffix."""
    rng = random.Random(seed)
    pool = token_pool(vocab_size, exclude_token_ids)
    prefix = random_ids(rng, prefix_len, pool)
    requests = []
    for _ in range(num_prompts):
        suffix = random_ids(rng, rng.randint(*suffix_len), pool)
        requests.append(BenchRequest(prefix + suffix, rng.randint(*output_len)))
    return Workload(
        "prefix",
        requests,
        {
            "prefix_len": prefix_len,
            "suffix_len": list(suffix_len),
            "output_len": list(output_len),
            "seed": seed,
        },
    )


def dataset_workload(
    path: str,
    tokenizer: Any,
    output_len: tuple[int, int],
    seed: int = 0,
    num_prompts: int | None = None,
) -> Workload:
    """Requests read from a JSONL file (see the module docstring); text prompts are tokenized."""
    rng = random.Random(seed)
    requests = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                prompt = item["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"{path}:{lineno}: expected a JSON object with a 'prompt' ({exc})."
                ) from None
            if isinstance(prompt, str):
                ids = list(tokenizer.encode(prompt, add_special_tokens=True))
            elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                ids = list(prompt)
            else:
                raise ValueError(f"{path}:{lineno}: 'prompt' must be a string or a list of token ids.")
            if not ids:
                raise ValueError(f"{path}:{lineno}: empty prompt.")
            n_out = item.get("output_len")
            if n_out is None:
                n_out = rng.randint(*output_len)
            if not isinstance(n_out, int) or n_out < 1:
                raise ValueError(f"{path}:{lineno}: 'output_len' must be a positive integer.")
            requests.append(BenchRequest(ids, n_out))
            if num_prompts is not None and len(requests) >= num_prompts:
                break
    if not requests:
        raise ValueError(f"{path}: no prompts found.")
    return Workload("dataset", requests, {"dataset": path, "seed": seed})


def add_workload_args(parser: argparse.ArgumentParser, *, prefix: bool, dataset: bool) -> None:
    """Add the workload flags (``--workload`` and the sizes) to a benchmark's parser."""
    choices = ["random", "prefix"] if prefix else ["random"]
    group = parser.add_argument_group("workload")
    group.add_argument(
        "--workload",
        choices=choices,
        default="random",
        help="Synthetic workload (default random; ignored with --dataset)." if dataset else "Workload.",
    )
    group.add_argument("--num-prompts", type=int, default=64, help="Number of requests (default 64).")
    group.add_argument(
        "--input-len",
        type=parse_range,
        default=(32, 256),
        metavar="MIN:MAX",
        help="Prompt length range of the random workload (default 32:256).",
    )
    group.add_argument(
        "--output-len",
        type=parse_range,
        default=(16, 256),
        metavar="MIN:MAX",
        help="Output length range (default 16:256).",
    )
    if prefix:
        group.add_argument(
            "--prefix-len",
            type=int,
            default=512,
            help="Length of the shared prompt of the prefix workload (default 512).",
        )
        group.add_argument(
            "--suffix-len",
            type=parse_range,
            default=(8, 32),
            metavar="MIN:MAX",
            help="Length range of the distinct suffixes of the prefix workload (default 8:32).",
        )
    if dataset:
        group.add_argument(
            "--dataset",
            default=None,
            metavar="FILE.jsonl",
            help='Prompts from a JSONL file of {"prompt": text or token ids, "output_len": N}.',
        )


def build_workload(
    args: argparse.Namespace,
    vocab_size: int,
    tokenizer: Any = None,
    exclude_token_ids: Iterable[int] = (),
) -> Workload:
    """The workload described by parsed :func:`add_workload_args` flags."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}.")
    if getattr(args, "dataset", None):
        if tokenizer is None:
            raise ValueError("a tokenizer is needed to read a dataset of text prompts.")
        return dataset_workload(args.dataset, tokenizer, args.output_len, args.seed, args.num_prompts)
    if args.workload == "prefix":
        if args.prefix_len < 1:
            raise ValueError(f"--prefix-len must be at least 1, got {args.prefix_len}.")
        return prefix_workload(
            args.num_prompts,
            args.prefix_len,
            args.suffix_len,
            args.output_len,
            vocab_size,
            args.seed,
            exclude_token_ids,
        )
    return random_workload(
        args.num_prompts, args.input_len, args.output_len, vocab_size, args.seed, exclude_token_ids
    )
