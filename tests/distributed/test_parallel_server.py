"""The OpenAI-compatible server over a model split on 2 tensor-parallel ranks, as a real ``pagedllm
serve --tensor-parallel-size 2`` process (in its default multiprocess form, where its engine core
starts rank 1, and with ``--no-multiprocess``), used with the official
``openai`` client: completions and chat completions equal one rank's offline outputs, streaming
equals non-streaming, a bad request is a 400 naming the field and the server keeps working,
``/metrics`` answers, and when the server stops no process of its tree is left. A split the model
does not allow stops the server at start-up."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import openai
import psutil
import pytest

from helpers.processes import alive, cmdline
from helpers.server import REPO_ROOT, RemoteServer, free_port
from pagedllm import LLM, SamplingParams

RANK_MODULE = "pagedllm.worker.parallel_executor"
MODEL = "tiny-tp2"
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "64"]
PROMPT = "The capital of France is"
CHAT: list[Any] = [{"role": "user", "content": "Name three colours."}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_path(tiny_model: Callable[[str], str]) -> str:
    return tiny_model("llama")


@pytest.fixture(
    scope="module",
    params=[
        # The engine in a core process of the server, which starts rank 1.
        pytest.param([], id="multiprocess"),
        # The engine on a thread of the server process, which starts rank 1 itself.
        pytest.param(["--no-multiprocess"], id="in-process", marks=pytest.mark.slow),
    ],
)
def server(request: pytest.FixtureRequest, model_path: str) -> Iterator[RemoteServer]:
    args = [
        model_path,
        "--tensor-parallel-size",
        "2",
        "--served-model-name",
        MODEL,
        *ENGINE_FLAGS,
        *request.param,
    ]
    with RemoteServer(args) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def one_rank(model_path: str) -> Iterator[LLM]:
    """The same model on one rank, in this process: the expected outputs."""
    llm = LLM(model_path, dtype="float32", max_model_len=256, num_kv_blocks=64)
    yield llm
    llm.shutdown()


def test_server_runs_two_ranks(server: RemoteServer) -> None:
    ranks = [p for p in psutil.Process(server.pid).children(recursive=True) if RANK_MODULE in cmdline(p)]
    assert len(ranks) == 1, [cmdline(p)[:120] for p in psutil.Process(server.pid).children(recursive=True)]


def test_completion_equals_one_rank(client: openai.OpenAI, one_rank: LLM) -> None:
    resp = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3, ignore_eos=True)
    expected = one_rank.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    choice = resp.choices[0]
    assert choice.text == expected.text and choice.finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == MAX_TOKENS
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert expected.logprobs is not None
    for got, want, token in zip(
        choice.logprobs.token_logprobs, expected.logprobs, expected.token_ids, strict=True
    ):
        assert got is not None and abs(got - want[token].logprob) < 1e-4


def test_chat_completion_equals_one_rank(client: openai.OpenAI, one_rank: LLM) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_completion_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = one_rank.chat(CHAT, params, use_tqdm=False)[0].outputs[0]
    message = resp.choices[0].message
    assert message.role == "assistant" and message.content == expected.text
    assert resp.usage is not None and resp.usage.completion_tokens == MAX_TOKENS


def test_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL, prompt="Once upon a time", max_tokens=MAX_TOKENS, temperature=0
    )
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    chat: dict[str, Any] = dict(model=MODEL, messages=CHAT, max_completion_tokens=MAX_TOKENS, temperature=0)
    full_chat = client.chat.completions.create(**chat)
    stream = list(client.chat.completions.create(stream=True, **chat))
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full_chat.choices[0].message.content


def test_bad_request_then_still_serving(server: RemoteServer, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=-1)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "max_tokens", info.value.body  # type: ignore[index]
    resp = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert resp.usage is not None and resp.usage.completion_tokens == 2


def test_metrics_answer_and_kv_blocks_free(server: RemoteServer) -> None:
    r = server.get("/metrics")
    assert r.status_code == 200
    samples = server.wait_idle()
    assert samples["pagedllm:generation_tokens_total"] > 0
    assert samples["pagedllm:request_success_total"] > 0


def test_stop_leaves_no_process(server: RemoteServer) -> None:
    """Last in this module: SIGTERM stops the server, its engine core and rank 1."""
    tree = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]
    assert any(RANK_MODULE in cmdline(p) for p in tree)
    server.terminate()
    assert server.wait(60) == 0, server.log_tail()
    for proc in tree:
        try:
            proc.wait(15)
        except psutil.TimeoutExpired:
            pass
    left = [(p.pid, cmdline(p)[:120]) for p in tree if alive(p)]
    assert not left, left


def test_refused_split_exits_with_the_reason(model_path: str) -> None:
    """A split the model does not allow (TP 3 over 4 heads) stops the server at start-up with status 1
    and the reason, instead of serving or hanging."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm", "serve", model_path, "--tensor-parallel-size", "3"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), *ENGINE_FLAGS]
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "tensor_parallel_size 3 does not divide the model's 4 attention heads" in result.stderr
