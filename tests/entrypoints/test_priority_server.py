"""Request priorities through every path a request takes: the OpenAI server (``priority`` in the body,
as vLLM's extension) over engine-core processes and over the in-process engine thread, the offline
``LLM`` with its engine in a core process, and the message that carries a request to a core.

A server started with ``--scheduling-policy priority`` and room for two sequences runs an urgent
request before low-priority requests that arrived earlier; a non-integer priority is a 400 naming
``priority``, and a server started with ``fcfs`` refuses any priority but 0 with a 400 naming
``priority`` and ``scheduling_policy``. Offline, a bad priority raises ValueError naming it, whether
the front-end or the core finds it, and the engine serves the next request with every KV block free.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from helpers.model_factory import make_tiny_hf_model
from helpers.server import RemoteServer
from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.engine_info import EngineInfo
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.proc.protocol import AddRequest, Codec, Hello, check_wire_priority

# Room for two sequences of the tests' lengths and little more: a third request waits.
PRIORITY_ARGS = ["--scheduling-policy", "priority", "--max-num-seqs", "2", "--num-kv-blocks", "72"]
SMALL = ["--max-model-len", "512"]
BAD_PRIORITIES: list[Any] = ["high", 1.5, True, 2**63]
LOW_TOKENS = 480  # the low-priority requests run long enough for an urgent one to arrive meanwhile


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_hf_model(tmp_path_factory.mktemp("priority_server"), "llama")


@pytest.fixture(scope="module")
def priority_server(tiny: str) -> Iterator[RemoteServer]:
    """Engine cores in their own processes (the default), scheduling by priority."""
    with RemoteServer([tiny, *PRIORITY_ARGS, *SMALL]) as srv:
        yield srv
        srv.wait_idle()


@pytest.fixture(scope="module")
def fcfs_server(tiny: str) -> Iterator[RemoteServer]:
    """The engine in the server's own process (one engine thread), first come first served."""
    with RemoteServer([tiny, "--no-multiprocess", "--num-kv-blocks", "64", *SMALL]) as srv:
        yield srv
        srv.wait_idle()


def served_model(server: RemoteServer) -> str:
    return str(server.client().models.list().data[0].id)


def refused(call: Any) -> dict[str, Any]:
    """The OpenAI error object of a call that must fail with 400."""
    with pytest.raises(openai.BadRequestError) as info:
        call()
    body = info.value.body
    assert isinstance(body, dict), body
    return body


# ------------------------------------------------------------------------------------------------
# The server
# ------------------------------------------------------------------------------------------------


async def _overtake(server: RemoteServer, model: str) -> tuple[dict[int, float], float, str]:
    """Four low-priority streams (two run, two wait), then an urgent request once two stream: the
    time each low one streamed its first chunk, when the urgent one finished, and its text."""
    client = server.async_client()
    first_chunk: dict[int, float] = {}
    two_streaming = asyncio.Event()

    async def low(i: int) -> None:
        stream = await client.completions.create(
            model=model,
            prompt=f"low priority request number {i}",
            max_tokens=LOW_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"priority": 1, "ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and i not in first_chunk:
                first_chunk[i] = time.monotonic()
                if len(first_chunk) == 2:
                    two_streaming.set()

    lows = []
    for i in range(4):
        lows.append(asyncio.create_task(low(i)))
        await asyncio.sleep(0.05)  # arrival order 0, 1, 2, 3
    await asyncio.wait_for(two_streaming.wait(), 60)
    assert sorted(first_chunk) == [0, 1], "the first two requests should run, the others wait"
    urgent = await client.completions.create(
        model=model,
        prompt="an urgent request",
        max_tokens=8,
        temperature=0,
        extra_body={"priority": -1, "ignore_eos": True},
    )
    done = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*lows), 120)
    await client.close()
    assert urgent.usage is not None and urgent.usage.completion_tokens == 8
    return first_chunk, done, urgent.choices[0].text


def test_urgent_request_runs_before_earlier_low_priority_ones(priority_server: RemoteServer) -> None:
    model = served_model(priority_server)
    before = priority_server.metrics().get("pagedllm:num_preemptions_total", 0.0)
    first_chunk, urgent_done, text = asyncio.run(_overtake(priority_server, model))
    # Under FCFS the urgent request would wait behind requests 2 and 3; by priority it preempts a
    # running one and has finished before either of them starts.
    assert urgent_done < min(first_chunk[2], first_chunk[3]), (first_chunk, urgent_done)
    after = priority_server.wait_for_metrics(lambda m: m.get("pagedllm:num_preemptions_total", 0.0) > before)
    assert after["pagedllm:num_preemptions_total"] > before, "no running request made way for the urgent one"
    # The urgent request's text is what the same prompt gives alone.
    alone = priority_server.client().completions.create(
        model=model, prompt="an urgent request", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert alone.choices[0].text == text
    priority_server.wait_idle()


def test_priority_server_takes_priorities_on_completions_and_chat(priority_server: RemoteServer) -> None:
    client = priority_server.client()
    model = served_model(priority_server)
    out = client.completions.create(
        model=model, prompt="hello", max_tokens=4, extra_body={"priority": 5, "ignore_eos": True}
    )
    assert out.usage is not None and out.usage.completion_tokens == 4
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        extra_body={"priority": -3, "ignore_eos": True},
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 4
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
        temperature=0,
        extra_body={"priority": 2, "ignore_eos": True},
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        == chat.choices[0].message.content
    )
    # /v1/responses is answered by the chat handler, priority included.
    response = client.responses.create(
        model=model, input="hi", max_output_tokens=4, temperature=0, extra_body={"priority": 7}
    )
    assert response.usage is not None and 1 <= response.usage.output_tokens <= 4, response
    priority_server.wait_idle()


def test_non_integer_priorities_are_400_naming_priority(priority_server: RemoteServer) -> None:
    client = priority_server.client()
    model = served_model(priority_server)
    for bad in BAD_PRIORITIES:
        body = refused(
            lambda bad=bad: client.completions.create(
                model=model, prompt="x", max_tokens=2, extra_body={"priority": bad}
            )
        )
        assert body["param"] == "priority" and "priority" in body["message"], (bad, body)
        body = refused(
            lambda bad=bad: client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "x"}],
                max_tokens=2,
                extra_body={"priority": bad},
            )
        )
        assert body["param"] == "priority", (bad, body)
    priority_server.wait_idle()


def test_fcfs_server_refuses_priorities_naming_the_policy(fcfs_server: RemoteServer) -> None:
    client = fcfs_server.client()
    model = served_model(fcfs_server)
    calls = [
        lambda: client.completions.create(model=model, prompt="x", max_tokens=2, extra_body={"priority": 2}),
        lambda: client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=2,
            extra_body={"priority": -1},
        ),
        lambda: client.completions.create(
            model=model, prompt=["a", "b"], max_tokens=2, stream=True, extra_body={"priority": 1}
        ),
    ]
    calls.append(
        lambda: client.responses.create(
            model=model, input="x", max_output_tokens=2, extra_body={"priority": 3}
        )
    )
    for call in calls:
        body = refused(call)
        assert body["param"] == "priority", body
        assert "scheduling_policy" in body["message"] and "--scheduling-policy priority" in body["message"]
    assert (
        refused(
            lambda: client.completions.create(
                model=model, prompt="x", max_tokens=2, extra_body={"priority": "1"}
            )
        )["param"]
        == "priority"
    )
    # Priority 0 is every request's on an fcfs server.
    out = client.completions.create(model=model, prompt="x", max_tokens=2, extra_body={"priority": 0})
    assert out.usage is not None and out.usage.completion_tokens >= 1
    fcfs_server.wait_idle()


# ------------------------------------------------------------------------------------------------
# The engines under the server and LLM
# ------------------------------------------------------------------------------------------------


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


PROMPTS = ["one two three", "four five", "six seven eight nine", "ten"]


@pytest.fixture(scope="module")
def reference(tiny: str) -> list[list[int]]:
    """Each prompt's tokens from an in-process engine."""
    llm = LLM(tiny, num_kv_blocks=64, max_model_len=256)
    outs = llm.generate(PROMPTS, params(12), use_tqdm=False)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def test_engine_in_a_core_process_takes_priorities(tiny: str, reference: list[list[int]]) -> None:
    llm = LLM(tiny, multiprocess=True, num_kv_blocks=64, max_model_len=256, scheduling_policy="priority")
    try:
        outs = llm.generate(PROMPTS, params(12), use_tqdm=False, priority=[3, -2, 0, 2**40])
        assert [list(o.outputs[0].token_ids) for o in outs] == reference
        for bad in BAD_PRIORITIES:
            with pytest.raises(ValueError, match="priority must be"):
                llm.generate(PROMPTS, params(4), use_tqdm=False, priority=[0, bad, 0, 0])
        engine = llm.llm_engine
        assert not engine.has_unfinished_requests()
        outs = llm.generate(PROMPTS[:2], params(12), use_tqdm=False, priority=[1, 1])
        assert [list(o.outputs[0].token_ids) for o in outs] == reference[:2]
        engine.check_idle()
    finally:
        llm.shutdown()


def test_engine_in_a_core_process_refuses_priorities_under_fcfs(
    tiny: str, reference: list[list[int]]
) -> None:
    llm = LLM(tiny, multiprocess=True, num_kv_blocks=64, max_model_len=256)
    engine: Any = llm.llm_engine
    try:
        assert engine.scheduling_policy == "fcfs"
        with pytest.raises(ValueError, match="priority 4: .*scheduling_policy 'priority'"):
            llm.generate(PROMPTS, params(4), use_tqdm=False, priority=[0, 4, 0, 0])
        # A front-end that lets the priority through (one that believed the cores took them): the
        # core refuses it, and the refusal comes back as the same ValueError, with nothing left behind.
        engine.scheduling_policy = "priority"
        with pytest.raises(ValueError, match="priority 4: .*scheduling_policy 'priority'"):
            llm.generate(PROMPTS[:1], params(4), use_tqdm=False, priority=[4])
        engine.scheduling_policy = "fcfs"
        assert not engine.has_unfinished_requests()
        outs = llm.generate(PROMPTS, params(12), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == reference
        engine.check_idle()
    finally:
        llm.shutdown()


def test_async_engine_checks_priorities_before_submitting(tiny: str) -> None:
    async def run(engine: AsyncLLMEngine) -> list[int]:
        with pytest.raises(ValueError, match="priority 3: .*scheduling_policy"):
            await engine.add_request("a", "one two", params(4), priority=3)
        for bad in BAD_PRIORITIES:
            with pytest.raises(ValueError, match="priority must be"):
                await engine.add_request("a", "one two", params(4), priority=bad)
        assert engine.num_active_requests == 0
        outs = [out async for out in engine.generate("one two", params(4), priority=0)]
        return list(outs[-1].outputs[0].token_ids)

    sync = LLMEngine.from_config(EngineConfig(model=tiny, num_kv_blocks=32, max_model_len=256))
    engine = AsyncLLMEngine(sync, log_stats_interval=None)
    engine.start()
    try:
        assert engine.scheduling_policy == "fcfs"
        assert len(asyncio.run(run(engine))) == 4
    finally:
        engine.shutdown()
    sync.check_idle()


def test_add_request_message_carries_the_priority() -> None:
    codec = Codec()
    message = codec.to_core.decode(codec.encode(AddRequest("r", [1, 2], sampling=params(2), priority=-7)))
    assert isinstance(message, AddRequest) and message.priority == -7
    default = codec.to_core.decode(codec.encode(AddRequest("r", [1], sampling=params(2))))
    assert isinstance(default, AddRequest) and default.priority == 0
    info = EngineInfo("m", "generate", 64, 100, [0], {}, 16, 8, 4, 5, True, scheduling_policy="priority")
    hello = codec.from_core.decode(codec.encode(Hello(0, info)))
    assert isinstance(hello, Hello) and hello.info.scheduling_policy == "priority"
    for bad in BAD_PRIORITIES + [-(2**63) - 1, None]:
        with pytest.raises(ValueError, match="priority must be"):
            check_wire_priority(bad)
    check_wire_priority(-(2**63))
    check_wire_priority(2**63 - 1)
