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
    structured = StructuredOutputsParams(json=schema if schema is not None else BENCHMARK_SCHEMA)
    prompts = [
        f"Describe {_SUBJECTS[i % len(_SUBJECTS)]} (person {i}) as a JSON record:"
        for i in range(num_requests)
    ]
    return _compare(llm, prompts, structured, max_tokens, repeats)


# Tools of the tool-call benchmark: what an agent declares, with bounded strings.
BENCHMARK_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 24},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_web",
            "description": "Search the web",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "maxLength": 32},
                    "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
                },
                "required": ["query"],
            },
        },
    },
]


def measure_tool_call_throughput(
    llm: LLM, num_requests: int = 32, max_tokens: int = 64, repeats: int = 1
) -> StructuredThroughput:
    """``tool_choice="required"`` against the same chat requests unconstrained (greedy, timed alike).

    The prompts are chats rendered with ``BENCHMARK_TOOLS`` in the template's tool section, so the
    engine's chat template must render tools (SmolLM2's own has no tools section: pagedllm renders
    them with its shipped ``pagedllm/model/chat_templates/smollm2_hermes_tools.jinja``, see
    :func:`pagedllm.model.tokenizer.tools_template`); the constraint is the server's own
    (:func:`pagedllm.entrypoints.openai.tool_calls.plan_tools`).
    """
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedllm.entrypoints.openai.tool_calls import plan_tools

    tokenizer = llm.get_tokenizer()
    questions = [
        f"What is the weather like where {_SUBJECTS[i % len(_SUBJECTS)]} number {i} lives?"
        for i in range(num_requests)
    ]
    prompts = [
        str(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}],
                tools=BENCHMARK_TOOLS,
                tokenize=False,
                add_generation_prompt=True,
            )
        )
        for q in questions
    ]
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": BENCHMARK_TOOLS, "tool_choice": "required"}
    )
    constraint = plan_tools(request, tool_parser=None, enable_auto_tool_choice=False).constraint
    assert constraint is not None
    return _compare(llm, prompts, constraint, max_tokens, repeats)


def _compare(
    llm: LLM, prompts: list[str], structured: StructuredOutputsParams, max_tokens: int, repeats: int
) -> StructuredThroughput:
    """Time ``prompts`` greedy with ``structured`` and then unconstrained (best of ``repeats``
    alternating runs).

    The unconstrained run generates, per prompt, exactly as many tokens as the constrained one did
    (``ignore_eos`` with that ``max_tokens``), so both runs do the same work but for the constraint:
    a constrained reply that ends early would otherwise make the comparison one of lengths.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}.")
    engine = llm.llm_engine
    constrained = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=structured)
    engine.structured_output_manager.compile(structured)
    warm_up = [
        SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=s) for s in (structured, None)
    ]
    llm.generate(prompts[:2], warm_up, use_tqdm=False)

    def run(params: SamplingParams | list[SamplingParams]) -> tuple[list[int], float]:
        engine.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return [len(o.outputs[0].token_ids) for o in outputs], elapsed

    lengths, constrained_seconds = run(constrained)
    plain = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    plain_lengths, plain_seconds = run(plain)
    for _ in range(repeats - 1):
        constrained_seconds = min(constrained_seconds, run(constrained)[1])
        plain_seconds = min(plain_seconds, run(plain)[1])
    return StructuredThroughput(
        len(prompts), sum(lengths), constrained_seconds, sum(plain_lengths), plain_seconds
    )
