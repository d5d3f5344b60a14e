"""The OpenAI-compatible server: end to end against real ``pagedllm serve`` processes, plus the async
engine and HTTP error paths against a scripted in-process engine."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from helpers.server import SMALL_ENGINE_ARGS, RemoteServer, parse_metrics
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from pagedllm.engine.observe.stats import EngineStats
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

MODEL = "test-model"
BODY_LIMIT = 200_000


# ================================================================================================
# Real server (default model)
# ================================================================================================


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    args = [*SMALL_ENGINE_ARGS, "--served-model-name", MODEL, "--max-request-body-bytes", str(BODY_LIMIT)]
    with RemoteServer(args) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


def _count_tokens(server: RemoteServer, **body: Any) -> int:
    r = server.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


def test_models_health_version(server: RemoteServer, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    raw = server.get("/v1/models").json()
    assert raw["data"][0]["max_model_len"] == 1024
    # The default model's recommended sampling (its model card's), which requests leaving them out get.
    assert raw["data"][0]["generation_config"] == {"temperature": 0.2, "top_p": 0.9}
    assert server.get("/health").status_code == 200
    assert server.get("/version").json()["version"]


def test_openai_shape_details(server: RemoteServer, client: openai.OpenAI) -> None:
    """``system_fingerprint`` on replies and on every stream chunk; a reply without calls has no
    ``tool_calls`` key (OpenAI leaves it out rather than sending [])."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    raw = server.post("/v1/chat/completions", json=chat).json()
    assert raw["system_fingerprint"].startswith("fp_pagedllm_")
    assert "tool_calls" not in raw["choices"][0]["message"], raw
    completion = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert completion.system_fingerprint == raw["system_fingerprint"]
    chunks = list(client.chat.completions.create(**chat, stream=True))
    assert chunks and all(c.system_fingerprint == raw["system_fingerprint"] for c in chunks)
    pieces = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stream=True))
    assert pieces and all(c.system_fingerprint == raw["system_fingerprint"] for c in pieces)
    response = server.post(
        "/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2}
    ).json()
    assert isinstance(response["created_at"], int), response


def test_truncate_prompt_tokens_keeps_the_last_tokens(server: RemoteServer, client: openai.OpenAI) -> None:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last N tokens (-1: the context length of 1024),
    at the limits; a truncated prompt generates what its last N tokens sent alone generate."""
    ids = [(i * 7919) % 20000 + 100 for i in range(1500)]
    greedy: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "temperature": 0}

    def complete(prompt: Any, **extra: Any) -> Any:
        return client.completions.create(prompt=prompt, **greedy, extra_body=extra)

    cut = complete(ids, truncate_prompt_tokens=1000)
    alone = complete(ids[-1000:])
    assert cut.usage.prompt_tokens == 1000 and cut.choices[0].text == alone.choices[0].text
    assert complete(ids, truncate_prompt_tokens=1).usage.prompt_tokens == 1
    assert complete(ids[:10], truncate_prompt_tokens=1021).usage.prompt_tokens == 10  # nothing to cut
    # -1: the context length, 1024 tokens: no room left for an output token.
    too_long = server.post(
        "/v1/completions", json={"prompt": ids, **greedy, "truncate_prompt_tokens": -1, "max_tokens": 1}
    )
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt", too_long.text
    assert complete(ids, truncate_prompt_tokens=1021).usage.prompt_tokens == 1021
    for bad in (0, -2, 1025, "5"):
        r = server.post("/v1/completions", json={"prompt": ids, **greedy, "truncate_prompt_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", (bad, r.text)
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "Hello there, how are you?"}],
        **greedy,
        extra_body={"truncate_prompt_tokens": 5},
    )
    assert chat.usage.prompt_tokens == 5
    server.wait_idle()


def test_completion_usage_and_tokenizer_count(server: RemoteServer, client: openai.OpenAI) -> None:
    from helpers.model_factory import default_tokenizer

    prompt = "The capital of France is"
    resp = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = resp.choices[0]
    assert resp.object == "text_completion" and resp.model == MODEL
    assert choice.text and choice.finish_reason == "length"
    assert resp.usage is not None
    expected_prompt_tokens = len(default_tokenizer().encode(prompt))
    assert resp.usage.prompt_tokens == expected_prompt_tokens == _count_tokens(server, prompt=prompt)
    assert resp.usage.completion_tokens == 5
    assert resp.usage.total_tokens == expected_prompt_tokens + 5
    assert resp.usage.prompt_tokens_details is not None
    assert isinstance(resp.usage.prompt_tokens_details.cached_tokens, int)


def test_completion_stream_matches_non_stream(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens  # type: ignore[union-attr]
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens  # type: ignore[union-attr]


def test_chat_stream_matches_non_stream(server: RemoteServer, client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "Name three colors."}]
    kwargs: dict[str, Any] = dict(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0)
    full = client.chat.completions.create(**kwargs)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content
    assert full.usage is not None
    assert full.usage.prompt_tokens == _count_tokens(server, messages=messages)
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    last_choice_chunk = [c for c in chunks if c.choices][-1]
    assert last_choice_chunk.choices[0].finish_reason == full.choices[0].finish_reason
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens is not None


def test_chat_content_parts_and_field_audit(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}],
        max_tokens=3,
        temperature=0,
        # OpenAI fields whose documented meaning holds here are accepted.
        extra_body={"ignore_eos": True, "prompt_cache_key": "k", "store": False, "service_tier": "auto"},
    )
    assert resp.usage is not None and resp.usage.completion_tokens == 3
    # A previous reply's message, sent back as history with OpenAI's null fields, is accepted.
    history = [
        {"role": "user", "content": "Hi"},
        resp.choices[0].message.model_dump(),
        {"role": "user", "content": "Again."},
    ]
    again = client.chat.completions.create(model=MODEL, messages=history, max_tokens=2)
    assert again.choices[0].message.content is not None
    # Anything else is refused, naming the field, never ignored.
    for body, param in (
        ({"some_future_field": {"x": 1}}, "some_future_field"),
        ({"store": True}, "store"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        (
            {"messages": [{"role": "user", "content": "Hi", "cache_control": {"type": "x"}}]},
            "messages[0].cache_control",
        ),
        ({"response_format": {"type": "json_object", "strict": True}}, "response_format.strict"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body=body
            )
        assert info.value.body["param"] == param, info.value.body  # type: ignore[index]
        assert "some_future_field" not in body or "unknown field" in info.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"frobnicate": 1})
    assert info.value.body["param"] == "frobnicate"  # type: ignore[index]


def test_stop_strings(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=12)
    base = client.completions.create(**kwargs).choices[0].text
    # Stop at the second word-ish piece of the greedy continuation.
    cut = base.find(",", 1)
    assert cut > 0, base
    stop = base[cut : cut + 2]
    resp = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert resp.finish_reason == "stop"
    assert resp.text == base[:cut]
    assert getattr(resp, "stop_reason", None) == stop
    streamed = list(client.completions.create(stop=[stop], stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in streamed) == base[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"
    kept = client.completions.create(stop=[stop], extra_body={"include_stop_str_in_output": True}, **kwargs)
    assert kept.choices[0].text == base[:cut] + stop


def test_n_choices(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL,
        prompt="A random word:",
        n=3,
        max_tokens=4,
        temperature=1.0,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert resp.usage is not None and resp.usage.completion_tokens == 12
    chat_chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            n=2,
            max_tokens=3,
            temperature=1.0,
            stream=True,
        )
    )
    finished = {c.choices[0].index for c in chat_chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}
    roles = {c.choices[0].index for c in chat_chunks if c.choices and c.choices[0].delta.role == "assistant"}
    assert roles == {0, 1}


def test_multiple_prompts_token_ids_and_echo(server: RemoteServer, client: openai.OpenAI) -> None:
    ids = server.post("/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    resp = client.completions.create(
        model=MODEL, prompt=["Hello there", "Good morning"], max_tokens=2, temperature=0
    )
    assert sorted(c.index for c in resp.choices) == [0, 1]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
    assert by_ids.choices[0].text == resp.choices[0].text
    assert server.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "Hello there"
    echoed = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=2, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "Hello there" + resp.choices[0].text


def test_logprobs(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=3, temperature=0, logprobs=2
    )
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs or []) == 3
    assert "".join(lp.tokens) == resp.choices[0].text
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) >= 2 for t in lp.top_logprobs or [])
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3
    assert all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content


BAD_REQUESTS: list[tuple[str, dict[str, Any] | str, int, str | None]] = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "suffix": "bye"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", '{"prompt": "hi", ', 400, None),
    ("/v1/completions", "[1, 2]", 400, None),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": -2}, 400, "n"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}, 404, "model"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "model": "nope"},
        404,
        "model",
    ),
    ("/v1/no-such-route", {}, 404, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_bad_requests(
    server: RemoteServer, path: str, body: dict[str, Any] | str, status: int, param: str | None
) -> None:
    if isinstance(body, str):
        r = server.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = server.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    assert err["param"] == param
    if status == 400:
        assert err["type"] == "invalid_request_error"
    if status == 404 and param == "model":
        assert err["code"] == "model_not_found"


def test_context_too_long_and_body_limit(server: RemoteServer, client: openai.OpenAI) -> None:
    long_prompt = "hello " * 1100
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=5)
    assert "maximum context length is 1024 tokens" in str(exc.value)
    r = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1024})
    assert r.status_code == 400 and "maximum context length is 1024 tokens" in r.json()["error"]["message"]
    r = server.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 1}
    )
    assert r.status_code == 400 and "maximum context length is 1024 tokens" in r.json()["error"]["message"]
    r = server.post("/v1/completions", json={"prompt": "x" * (BODY_LIMIT + 10)})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # None of the rejected requests is left behind.
    samples = server.metrics()
    assert samples["pagedllm:num_requests_running"] == 0
    assert samples["pagedllm:num_requests_waiting"] == 0


def test_openai_client_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1
        )
    assert bad.value.status_code == 400
    assert bad.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)


def test_tokenize_detokenize(server: RemoteServer) -> None:
    r = server.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 1024
    assert server.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "Hello world"
    chat = server.post("/tokenize", json={"messages": [{"role": "user", "content": "Hello"}]}).json()
    assert chat["count"] > r["count"]
    assert server.post("/tokenize", json={}).status_code == 400
    assert server.post("/detokenize", json={"tokens": [-1]}).json()["error"]["param"] == "tokens"


def test_metrics_names(server: RemoteServer) -> None:
    r = server.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = parse_metrics(r.text)
    for name in (
        "pagedllm:num_requests_running",
        "pagedllm:num_requests_waiting",
        "pagedllm:kv_cache_usage_perc",
        "pagedllm:prompt_tokens_total",
        "pagedllm:prompt_tokens_cached_total",
        "pagedllm:prompt_tokens_by_source_total",
        "pagedllm:prompt_tokens_computed_total",
        "pagedllm:generation_tokens_total",
        "pagedllm:request_success_total",
        "pagedllm:sequence_success_total",
        "pagedllm:request_prompt_tokens_count",
        "pagedllm:request_generation_tokens_count",
        "pagedllm:num_preemptions_total",
        "pagedllm:prefix_cache_queries_total",
        "pagedllm:prefix_cache_hits_total",
        "pagedllm:time_to_first_token_seconds_count",
        "pagedllm:inter_token_latency_seconds_count",
        "pagedllm:e2e_request_latency_seconds_count",
        "pagedllm:request_queue_time_seconds_count",
    ):
        assert name in samples, name
    # Earlier tests generated text, so the counters and histograms have moved.
    assert samples["pagedllm:generation_tokens_total"] > 0
    assert samples["pagedllm:request_success_total"] > 0
    assert samples["pagedllm:e2e_request_latency_seconds_count"] > 0
    assert 'finished_reason="length"' in r.text


def test_latency_metrics_count_every_token(server: RemoteServer, client: openai.OpenAI) -> None:
    """Streamed or not (a response that is not streamed gets only the engine's final output), a
    request of k tokens adds one time-to-first-token, k - 1 inter-token latencies and one end-to-end
    latency, all from the engine's own token times. Time to first token runs from the request's
    arrival at the front-end to the engine's first token, mapped onto the front-end's clock as the
    core sent it: within the request's end-to-end latency, itself within what the client saw,
    however slow the machine (tests/entrypoints/test_server_metrics.py has the long-prefill case)."""
    names = (
        "pagedllm:time_to_first_token_seconds_count",
        "pagedllm:inter_token_latency_seconds_count",
        "pagedllm:e2e_request_latency_seconds_count",
        "pagedllm:time_to_first_token_seconds_sum",
        "pagedllm:e2e_request_latency_seconds_sum",
    )
    kwargs: dict[str, Any] = dict(
        model=MODEL, prompt="The sky is", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    for stream in (False, True):
        before = parse_metrics(server.get("/metrics").text)
        started = time.monotonic()
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
        else:
            text = client.completions.create(**kwargs).choices[0].text
        elapsed = time.monotonic() - started
        after = parse_metrics(server.get("/metrics").text)
        ttft, itl, e2e, ttft_sum, e2e_sum = (after[n] - before[n] for n in names)
        assert text and (ttft, itl, e2e) == (1, 5, 1), stream
        assert 0 < ttft_sum <= e2e_sum < elapsed, (ttft_sum, e2e_sum, elapsed)


@pytest.mark.slow
def test_concurrent_streams(server: RemoteServer) -> None:
    async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[str, int, str | None]:
        stream = await aclient.completions.create(
            model=MODEL,
            prompt=f"Item {i}:",
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, tokens, finish = "", -1, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return text, tokens, finish

    async def main() -> list[tuple[str, int, str | None]]:
        async with server.async_client() as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32
    assert all(tokens == 4 and finish == "length" for _, tokens, finish in results), results
    samples = server.wait_for_metrics(lambda s: s["pagedllm:num_requests_running"] == 0, timeout=5)
    assert samples["pagedllm:num_requests_running"] == 0


@pytest.mark.slow
def test_client_disconnect_frees_request(server: RemoteServer) -> None:
    idle = server.metrics()
    assert idle["pagedllm:num_requests_running"] == 0
    idle_kv = idle["pagedllm:kv_cache_usage_perc"]

    def settled(s: dict[str, float]) -> bool:
        return s["pagedllm:num_requests_running"] == 0 and s["pagedllm:kv_cache_usage_perc"] == idle_kv

    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "stream": True}
    body["ignore_eos"] = True
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url("/v1/completions"), json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            seen = 0
            for line in lines:
                if line.startswith("data: "):
                    seen += 1
                if seen >= 2:
                    break
            running = server.metrics()
            assert running["pagedllm:num_requests_running"] == 1
            assert running["pagedllm:kv_cache_usage_perc"] > idle_kv
    samples = server.wait_for_metrics(settled, timeout=5)
    assert settled(samples), samples

    # A non-streaming request whose client gives up is aborted too.
    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url("/v1/completions"), json=body, timeout=1.5)
    samples = server.wait_for_metrics(settled, timeout=5)
    assert settled(samples), samples


@pytest.mark.slow
def test_server_scheduling_ahead_gives_the_same_outputs(client: openai.OpenAI) -> None:
    """A server that schedules each step before the previous one's tokens reach the host streams
    and returns what the default server does, with stop strings, EOS and lengths, concurrently."""
    requests: list[dict[str, Any]] = [
        dict(prompt="1, 2, 3, 4,", max_tokens=12, stop=[" 7"]),
        dict(prompt="Once upon a time", max_tokens=16),
        dict(prompt="The capital of France is", max_tokens=24, stop=["."]),
        dict(prompt="Roses are red,", max_tokens=9, extra_body={"ignore_eos": True}),
    ]
    expected = [client.completions.create(model=MODEL, temperature=0, **r).choices[0] for r in requests]
    with RemoteServer([*SMALL_ENGINE_ARGS, "--served-model-name", MODEL, "--async-scheduling"]) as ahead:

        async def one(aclient: openai.AsyncOpenAI, r: dict[str, Any]) -> tuple[str, str | None, str]:
            full = (await aclient.completions.create(model=MODEL, temperature=0, **r)).choices[0]
            stream = await aclient.completions.create(model=MODEL, temperature=0, stream=True, **r)
            text, finish = "", None
            async for chunk in stream:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            assert finish == full.finish_reason
            return full.text, full.finish_reason, text

        async def main() -> list[tuple[str, str | None, str]]:
            async with ahead.async_client() as aclient:
                return await asyncio.gather(*(one(aclient, r) for r in requests * 4))

        assert "scheduling ahead on" in ahead.log_tail(lines=1000)
        results = asyncio.run(main())
        for i, (text, finish, streamed) in enumerate(results):
            e = expected[i % len(requests)]
            assert (text, finish, streamed) == (e.text, e.finish_reason, e.text), i
        idle = ahead.wait_for_metrics(lambda s: s["pagedllm:num_requests_running"] == 0, timeout=5)
        assert idle["pagedllm:num_requests_running"] == 0 and idle["pagedllm:kv_cache_usage_perc"] == 0


# ------------------------------------------------------------------------------------------------
# A second server: API key, a one-sequence batch with a one-request queue, then SIGTERM.
# ------------------------------------------------------------------------------------------------

API_KEY = "sk-test-secret"


@pytest.fixture(scope="module")
def guarded_server() -> Iterator[RemoteServer]:
    args = [
        *SMALL_ENGINE_ARGS,
        "--max-num-seqs",
        "1",
        "--max-queued-requests",
        "1",
        "--shutdown-timeout",
        "60",
    ]
    with RemoteServer(args, api_key=API_KEY) as srv:
        yield srv


@pytest.mark.slow
def test_api_key(guarded_server: RemoteServer) -> None:
    url = guarded_server.url("/v1/models")
    assert httpx.get(url).status_code == 401
    wrong = httpx.get(url, headers={"Authorization": "Bearer wrong"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    assert httpx.post(guarded_server.url("/v1/completions"), json={"prompt": "x"}).status_code == 401
    assert httpx.get(guarded_server.url("/health")).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded_server.url("/v1"), api_key="bad", max_retries=0).models.list()
    client = guarded_server.client()
    name = client.models.list().data[0].id
    resp = client.completions.create(model=name, prompt="Hi", max_tokens=1)
    assert resp.usage is not None and resp.usage.completion_tokens == 1


def _stream_in_thread(srv: RemoteServer, body: dict[str, Any], out: dict[str, Any]) -> threading.Event:
    """Start a streaming completion in a thread; the event is set once its first chunk arrived."""
    started = threading.Event()

    def run() -> None:
        text = ""
        try:
            with httpx.stream(
                "POST", srv.url("/v1/completions"), json=body, headers=srv.headers(), timeout=120
            ) as r:
                out["status"] = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    started.set()
                    for choice in chunk.get("choices", []):
                        text += choice["text"]
                        out["finish_reason"] = choice["finish_reason"] or out.get("finish_reason")
                    if chunk.get("usage"):
                        out["usage"] = chunk["usage"]
        except Exception as exc:  # noqa: BLE001 - reported to the test through `out`
            out["error"] = exc
        finally:
            out["text"] = text
            started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    out["thread"] = thread
    return started


@pytest.mark.slow
def test_queue_limit(guarded_server: RemoteServer) -> None:
    srv = guarded_server
    # Long enough (a second or more) for the second request to be seen waiting behind it.
    body = {"prompt": "Count:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    first: dict[str, Any] = {}
    assert _stream_in_thread(srv, body, first).wait(60)
    second: dict[str, Any] = {}
    _stream_in_thread(srv, {**body, "max_tokens": 2}, second)
    samples = srv.wait_for_metrics(lambda s: s["pagedllm:num_requests_waiting"] == 1, timeout=10)
    assert samples["pagedllm:num_requests_waiting"] == 1
    r = srv.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "queue_full"
    for out in (first, second):
        out["thread"].join(60)
        assert "error" not in out and out["status"] == 200
    assert first["usage"]["completion_tokens"] == 400 and second["usage"]["completion_tokens"] == 2
    assert srv.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


@pytest.mark.slow
def test_sigterm_drains_in_flight_request(guarded_server: RemoteServer) -> None:
    srv = guarded_server
    out: dict[str, Any] = {}
    # Long enough (a second or more) to be still running when the signal arrives.
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    assert _stream_in_thread(srv, body, out).wait(60)
    srv.terminate()
    deadline = time.monotonic() + 5
    health = srv.get("/health").status_code
    while health != 503 and time.monotonic() < deadline:
        time.sleep(0.05)
        health = srv.get("/health").status_code
    assert health == 503
    refused = srv.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    out["thread"].join(60)
    assert "error" not in out, out
    assert out["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 400
    assert srv.wait(30) == 0, srv.log_tail()


# ================================================================================================
# In-process: the async engine and HTTP error paths against a scripted engine
# ================================================================================================


class ScriptedTokenizer:
    """One character per token (vocabulary of 256)."""

    chat_template = "role: content"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 256 for c in text]

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


class ScriptedEngine:
    """Generates "a" per step per request (cumulative outputs, or the one new "a" for DELTA); at
    most ``max_running`` run, the rest wait.

    ``fail_at_step`` makes the n-th step raise, as a crashing model would.
    """

    model_name = "scripted"
    max_model_len = 64
    vocab_size = 256

    def __init__(self, max_running: int = 8, fail_at_step: int | None = None) -> None:
        self.tokenizer = ScriptedTokenizer()
        self.max_running = max_running
        self.fail_at_step = fail_at_step
        self.steps = 0
        self.requests: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.aborted: list[str] = []
        self.output_kinds: list[RequestOutputKind] = []

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        if lora_request is not None:
            raise ValueError("this engine has no adapters.")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty.")
        self.requests[request_id] = (ids, params, [])
        self.output_kinds.append(params.output_kind)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        time.sleep(0.005)
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            raise RuntimeError("scripted failure")
        outputs = []
        for rid in list(self.requests)[: self.max_running]:
            ids, params, out = self.requests[rid]
            out.append(ord("a"))
            done = len(out) >= (params.max_tokens or 1)
            if params.output_kind is RequestOutputKind.DELTA:  # what this step adds
                completion = CompletionOutput(0, "a", [ord("a")], None, None, "length" if done else None)
            else:
                completion = CompletionOutput(
                    0, "a" * len(out), list(out), None, None, "length" if done else None
                )
            outputs.append(RequestOutput(rid, None, ids, [completion], done))
            if done:
                del self.requests[rid]
        return outputs

    def abort_request(self, request_id: str | Any) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            if self.requests.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def pop_token_intervals(self) -> list[float]:
        return []

    def get_stats(self) -> EngineStats:
        running = min(len(self.requests), self.max_running)
        return EngineStats(num_running=running, num_waiting=len(self.requests) - running)


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_async_engine_generate_validate_abort() -> None:
    fake = ScriptedEngine()
    engine = AsyncLLMEngine(fake)
    engine.start()

    async def main() -> None:
        outs = [o async for o in engine.generate("hi", SamplingParams(max_tokens=3), "r1")]
        assert [len(o.outputs[0].token_ids) for o in outs][-1] == 3 and outs[-1].finished
        with pytest.raises(ValueError, match="prompt must not be empty"):
            await engine.add_request("r2", "", SamplingParams())
        stream = await engine.add_request("r3", "hi", SamplingParams(max_tokens=50))
        first = await anext(stream)
        assert not first.finished
        await stream.aclose()  # type: ignore[attr-defined]
        for _ in range(200):
            if "r3" in fake.aborted:
                break
            await asyncio.sleep(0.01)
        assert "r3" in fake.aborted and engine.num_active_requests == 0

    try:
        _run(main())
    finally:
        engine.shutdown()


def test_async_engine_queue_limit() -> None:
    fake = ScriptedEngine(max_running=1)
    engine = AsyncLLMEngine(fake, max_queued_requests=1)
    engine.start()

    async def main() -> None:
        a = await engine.add_request("a", "x", SamplingParams(max_tokens=40))
        await anext(a)  # "a" is running
        b = await engine.add_request("b", "x", SamplingParams(max_tokens=1))  # "b" waits
        with pytest.raises(QueueFullError):
            await engine.add_request("c", "x", SamplingParams(max_tokens=1))
        engine.abort(["a", "b"])
        del a, b

    try:
        _run(main())
    finally:
        engine.shutdown()


def test_async_engine_death_fails_requests() -> None:
    engine = AsyncLLMEngine(ScriptedEngine(fail_at_step=3))
    engine.start()

    async def main() -> None:
        stream = await engine.add_request("a", "x", SamplingParams(max_tokens=40))
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            await engine.add_request("b", "x", SamplingParams(max_tokens=1))

    try:
        _run(main())
    finally:
        engine.shutdown()


def _scripted_app(fake: ScriptedEngine) -> tuple[Any, AsyncLLMEngine]:
    from pagedllm.engine.observe.metrics import EngineMetrics
    from pagedllm.entrypoints.openai.api_server import ServerSettings, build_app

    engine = AsyncLLMEngine(fake, metrics=EngineMetrics("scripted"))
    return build_app(engine, ServerSettings(served_model_names=["scripted"]), engine.metrics), engine


def test_http_engine_death_and_stream_error() -> None:
    from fastapi.testclient import TestClient

    app, engine = _scripted_app(ScriptedEngine(fail_at_step=4))
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 20, "stream": True})
        assert r.status_code == 200
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_dead" and error["type"] == "server_error"
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    assert not engine.is_running


def test_http_scripted_chat_and_completion() -> None:
    from fastapi.testclient import TestClient

    app, _ = _scripted_app(ScriptedEngine())
    with TestClient(app) as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        body = r.json()
        # No max_tokens: the rest of the context (64 - prompt length).
        prompt_len = len("user: hi\nassistant: ")
        assert body["usage"] == {
            "prompt_tokens": prompt_len,
            "completion_tokens": 64 - prompt_len,
            "total_tokens": 64,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        r = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "n": 1, "stop": ["zz"]})
        assert r.json()["choices"][0]["text"] == "aa"
        samples = parse_metrics(http.get("/metrics").text)
        assert samples["pagedllm:request_success_total"] == 2
        assert samples["pagedllm:generation_tokens_total"] == 0  # the scripted engine reports no counters


def test_a_dropped_app_frees_its_engine() -> None:
    """Once an app has served every route and is dropped, nothing keeps its engine alive (FastAPI
    caches facts about endpoint functions process-wide, so handlers must not close over the engine,
    whose weights and KV cache would otherwise stay allocated)."""
    import gc
    import weakref

    from fastapi.testclient import TestClient

    fake = ScriptedEngine()
    app, engine = _scripted_app(fake)
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/v1/models").json()["data"][0]["id"] == "scripted"
        assert http.get("/version").status_code == 200 and http.get("/metrics").status_code == 200
        r = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
        assert r.json()["choices"][0]["text"] == "aa"
        r = http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        )
        assert r.status_code == 200
        assert http.post("/tokenize", json={"prompt": "ab"}).json()["count"] == 2
        assert http.post("/detokenize", json={"tokens": [97]}).status_code == 200
    refs = [weakref.ref(fake), weakref.ref(engine), weakref.ref(app)]
    del fake, engine, app, http, r
    gc.collect()
    assert [ref() is None for ref in refs] == [True, True, True]


def test_text_chunk_events_match_the_models_json() -> None:
    """Streamed text chunks skip building a model per chunk: their events are byte for byte the
    chunk models' JSON, for any text and choice index, and fall back to the model when the marker
    cannot be placed."""
    from pagedllm.entrypoints.openai.protocol import (
        ChatCompletionResponseStreamChoice,
        ChatCompletionStreamResponse,
        CompletionResponseChoice,
        CompletionStreamResponse,
        DeltaMessage,
    )
    from pagedllm.entrypoints.openai.streaming import TextChunkEvents, sse_event

    def chat(index: int, text: str) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(
            id='chatcmpl-"1"',
            created=17,
            model="m\\odel",
            choices=[ChatCompletionResponseStreamChoice(index=index, delta=DeltaMessage(content=text))],
        )

    def completion(index: int, text: str) -> CompletionStreamResponse:
        return CompletionStreamResponse(
            id="cmpl-2", created=18, model="m", choices=[CompletionResponseChoice(index=index, text=text)]
        )

    def twice(index: int, text: str) -> CompletionStreamResponse:
        return CompletionStreamResponse(
            id="cmpl-3", created=19, model=text, choices=[CompletionResponseChoice(index=index, text=text)]
        )

    texts = ["", " hello", 'a "quoted" \\ path', "line\nnext\ttab", "\x00\x1f\x7f", "é中😀\u2028", "\ufffd"]
    for make in (chat, completion, twice):
        events = TextChunkEvents(make)
        for index in (0, 3, 0):
            for text in texts:
                expected = sse_event(make(index, text).model_dump_json())
                assert events.event(index, text) == expected
                assert json.loads(expected[len("data: ") :])["choices"][0]["index"] == index


def test_http_scripted_streams_carry_every_character() -> None:
    """Streams over HTTP with the scripted engine: every generated character arrives once, in
    order, for chat and completions, and the last chunk finishes (text chunks after the first are
    written from a template, see ``test_text_chunk_events_match_the_models_json``). Streamed
    requests ask the engine for delta outputs, the others for the final one only."""
    from fastapi.testclient import TestClient

    fake = ScriptedEngine()
    app, _ = _scripted_app(fake)
    with TestClient(app) as http:
        for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/completions", {"prompt": "abc"}),
        ):
            with http.stream("POST", path, json={**body, "max_tokens": 7, "stream": True}) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            text, finishes = "", []
            for line in lines[:-1]:
                (choice,) = json.loads(line[len("data: ") :])["choices"]
                assert not finishes  # nothing after the finishing chunk
                text += (choice["delta"].get("content") if "delta" in choice else choice["text"]) or ""
                if choice["finish_reason"] is not None:
                    finishes.append(choice["finish_reason"])
            assert (text, finishes) == ("a" * 7, ["length"]), path
            http.post(path, json={**body, "max_tokens": 3})
    # Streams need every step's output; a response that is not streamed only the final one.
    assert fake.output_kinds == [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY] * 2
