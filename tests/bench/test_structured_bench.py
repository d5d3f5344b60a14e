"""The structured-output and tool-call benchmarks on a few requests: both runs do the same work."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.tool_calls import JsonArrayToolParser, plan_tools
from pagedllm.sampling_params import SamplingParams
from pagedllm_bench.structured import (
    BENCHMARK_SCHEMA,
    BENCHMARK_TOOLS,
    measure_structured_throughput,
    measure_tool_call_throughput,
)


def test_structured_benchmark_compares_equal_work(default_llm: Any) -> None:
    result = measure_structured_throughput(default_llm, num_requests=3, max_tokens=24)
    assert result.num_requests == 3
    assert result.constrained_tokens == result.unconstrained_tokens > 0
    assert result.ratio > 0
    assert BENCHMARK_SCHEMA["required"]
    default_llm.llm_engine.check_idle()


def test_tool_call_benchmark_generates_valid_calls(tool_llm: Any) -> None:
    llm = tool_llm
    result = measure_tool_call_throughput(llm, num_requests=3, max_tokens=48)
    assert result.constrained_tokens == result.unconstrained_tokens > 0
    # The constrained replies are the server's required tool calls, naming declared functions.
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in BENCHMARK_TOOLS}
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Weather in Oslo?"}],
        tools=BENCHMARK_TOOLS,
        tokenize=False,
        add_generation_prompt=True,
    )
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": BENCHMARK_TOOLS, "tool_choice": "required"}
    )
    constraint = plan_tools(request, tool_parser=None, enable_auto_tool_choice=False).constraint
    [out] = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=48, structured_outputs=constraint)
    )
    extracted = JsonArrayToolParser().extract(out.outputs[0].text)
    assert extracted.tools_called, out.outputs[0].text
    for call in extracted.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    llm.llm_engine.check_idle()
