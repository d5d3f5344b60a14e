"""Throughput of JSON-schema-constrained generation against the same batch unconstrained."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from pagedllm.entrypoints.llm import LLM

BENCHMARK_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "zip": {"type": "integer"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "role", "skills", "address"],
}

_SUBJECTS = [
    "an engineer",
    "a teacher",
    "a pilot",
    "a chef",
    "a doctor",
    "an artist",
    "a farmer",
    "a student",
]


@dataclass
class StructuredThroughput:
    """Output tokens and wall time of one batch run constrained and unconstrained."""

    num_requests: int
    constrained_tokens: int
    constrained_seconds: float
    unconstrained_tokens: int
    unconstrained_seconds: float

    @property
    def constrained_tokens_per_s(self) -> float:
        return self.constrained_tokens / max(self.constrained_seconds, 1e-9)

    @property
    def unconstrained_tokens_per_s(self) -> float:
        return self.unconstrained_tokens / max(self.unconstrained_seconds, 1e-9)

    @property
    def ratio(self) -> float:
        """Constrained over unconstrained output tokens per second (1.0: no overhead)."""
        return self.constrained_tokens_per_s / max(self.unconstrained_tokens_per_s, 1e-9)


def measure_structured_throughput(
    llm: LLM,
    num_requests: int = 32,
    max_tokens: int = 64,
    schema: dict[str, Any] | None = None,
    repeats: int = 1,
) -> StructuredThroughput:
    """Generate a batch of ``num_requests`` greedy requests with and without a JSON schema; time both.

    The grammar is compiled and both paths warmed up before timing, and the prefix cache is reset
    before each run so neither reuses the other's prompt blocks. With ``repeats > 1`` the two runs
    alternate and the fastest time of each is kept (greedy outputs are the same every time).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}.")
    engine = llm.llm_engine
    structured = StructuredOutputsParams(json=schema if schema is not None else BENCHMARK_SCHEMA)
    prompts = [
        f"Describe {_SUBJECTS[i % len(_SUBJECTS)]} (person {i}) as a JSON record:"
        for i in range(num_requests)
    ]
    constrained = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=structured)
    plain = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    engine.structured_output_manager.compile(structured)
    warm_up = [
        SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=s) for s in (structured, None)
    ]
    llm.generate(prompts[:2], warm_up, use_tqdm=False)

    def run(params: SamplingParams) -> tuple[int, float]:
        engine.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return sum(len(o.outputs[0].token_ids) for o in outputs), elapsed

    plain_tokens = constrained_tokens = 0
    plain_seconds = constrained_seconds = float("inf")
    for _ in range(repeats):
        plain_tokens, seconds = run(plain)
        plain_seconds = min(plain_seconds, seconds)
        constrained_tokens, seconds = run(constrained)
        constrained_seconds = min(constrained_seconds, seconds)
    return StructuredThroughput(
        num_requests, constrained_tokens, constrained_seconds, plain_tokens, plain_seconds
    )
