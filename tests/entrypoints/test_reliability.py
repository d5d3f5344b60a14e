"""The server against hostile or careless clients: numbers the engine must never see, unbounded
``n`` and queues, client chat templates, inputs too large for the event loop, the API key on every
route, and an API document that matches the answers. Two real ``pagedllm serve`` processes (one that
trusts request chat templates, one behind an API key with a two-sequence batch and a queue of four
sequences) plus an in-process app for the flags that change the routes."""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from helpers.idle_engine import IdleEngine
from helpers.server import SMALL_ENGINE_ARGS, RemoteServer, parse_metrics

MODEL = "reliability-model"
API_KEY = "sk-reliability"
MAX_MODEL_LEN = 1024  # SMALL_ENGINE_ARGS
PROMPT_BYTES = 32 * MAX_MODEL_LEN  # the default --max-prompt-bytes
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    args = [
        *SMALL_ENGINE_ARGS,
        "--served-model-name",
        MODEL,
        "--trust-request-chat-template",
        "--chat-template-timeout",
        "1",
    ]
    with RemoteServer(args) as srv:
        yield srv


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[RemoteServer]:
    args = [
        *SMALL_ENGINE_ARGS,
        "--served-model-name",
        MODEL,
        "--max-num-seqs",
        "2",
        "--max-queued-requests",
        "4",
    ]
    with RemoteServer(args, api_key=API_KEY) as srv:
        yield srv


def _post_raw(srv: RemoteServer, path: str, body: str) -> httpx.Response:
    return srv.post(path, content=body, headers={"Content-Type": "application/json"}, timeout=30)


def _assert_error(r: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["param"] == param, err
    return dict(err)


def _max_latency_while(
    srv: RemoteServer, busy: Callable[[], bool], path: str = "/health"
) -> tuple[float, int]:
    """Poll ``path`` while ``busy()``: the slowest answer and the number of polls."""
    worst, polls = 0.0, 0
    deadline = time.monotonic() + 60
    while busy() and time.monotonic() < deadline:
        started = time.monotonic()
        assert srv.get(path, timeout=10).status_code == 200
        worst = max(worst, time.monotonic() - started)
        polls += 1
        time.sleep(0.05)
    return worst, polls


class InThread:
    """Run ``fn`` in a daemon thread, keeping its result or exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:  # noqa: BLE001 - reported by join()
            self.error = exc

    def alive(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout: float = 60) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "still running"
        if self.error is not None:
            raise self.error
        return self.result


class Stream:
    """A streamed completion in a thread: ``first`` is set at its first chunk; ``stop`` closes it."""

    def __init__(self, srv: RemoteServer, body: dict[str, Any]) -> None:
        self.first = threading.Event()
        self.stop = threading.Event()
        self.status: int | None = None
        self.chunks = 0

        def run() -> None:
            with httpx.stream(
                "POST",
                srv.url("/v1/completions"),
                json={**body, "stream": True},
                headers=srv.headers(),
                timeout=60,
            ) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.chunks += 1
                        self.first.set()
                    if self.stop.is_set():
                        return

        self.job = InThread(run)


# ================================================================================================
# 1. Non-finite and absurd numbers, booleans as token ids, chat roles
# ================================================================================================

NON_FINITE: list[tuple[str, str, str]] = [
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 1, "temperature": 1e999}', "temperature"),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 1, "temperature": NaN}', "temperature"),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 1, "temperature": 1e300}', "temperature"),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 1, "temperature": true}', "temperature"),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 1, "top_p": Infinity}', "top_p"),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 1, "min_p": NaN}', "min_p"),
    (
        "/v1/completions",
        '{"prompt": "Hi", "max_tokens": 1, "presence_penalty": -Infinity}',
        "presence_penalty",
    ),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 1, "frequency_penalty": NaN}', "frequency_penalty"),
    (
        "/v1/completions",
        '{"prompt": "Hi", "max_tokens": 1, "repetition_penalty": 1e999}',
        "repetition_penalty",
    ),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 1, "length_penalty": NaN}', "length_penalty"),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 1, "logit_bias": {"5": NaN}}', "logit_bias"),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 1, "logit_bias": {"5": -1e999}}', "logit_bias"),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 1, "seed": 1180591620717411303424}', "seed"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}',
        "temperature",
    ),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "top_p": 1e999}', "top_p"),
]

NOT_TOKEN_IDS: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "allowed_token_ids": [True]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "stop_token_ids": [False]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "stop_token_ids": [1.0]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "logit_bias": {"true": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "logit_bias": {"1_0": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "logit_bias": {"5": True}}, "logit_bias"),
    ("/v1/completions", {"prompt": [True, False], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": [[1, True]], "max_tokens": 1}, "prompt"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "function", "content": "Hi"}]}, "messages"),
    ("/tokenize", {"messages": [{"role": "", "content": "Hi"}]}, "messages"),
]


def test_non_finite_and_absurd_numbers_are_refused(server: RemoteServer) -> None:
    before = server.metrics()
    for path, body, param in NON_FINITE:
        err = _assert_error(_post_raw(server, path, body), 400, param)
        assert err["type"] == "invalid_request_error" and param in err["message"], (body, err)
    for path, json_body, param in NOT_TOKEN_IDS:
        _assert_error(server.post(path, json=json_body, timeout=30), 400, param)
    # Every valid role is accepted.
    for role in ("system", "developer", "user", "assistant", "tool"):
        message = {"role": role, "content": "Hi"} | ({"tool_call_id": "call_1"} if role == "tool" else {})
        r = server.post("/tokenize", json={"messages": [message]})
        assert r.status_code == 200, (role, r.text)
    # Nothing reached the engine.
    after = server.wait_idle()
    for name in ("pagedllm:prompt_tokens_total", "pagedllm:request_success_total"):
        assert after[name] == before[name], name


# ================================================================================================
# 2. n and the queue of waiting sequences
# ================================================================================================


def test_n_is_bounded_by_max_num_seqs(server: RemoteServer) -> None:
    started = time.monotonic()
    for path, body in (
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "n": 1_000_000_000}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "n": 257}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "n": 100_000, "use_beam_search": True}),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 1, "n": 1_000_000_000}),
    ):
        err = _assert_error(server.post(path, json=body, timeout=30), 400, "n")
        assert "max_num_seqs" in err["message"] and "256" in err["message"], err
    assert time.monotonic() - started < 10
    ok = server.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "n": 16})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 16, ok.text[:300]
    server.wait_idle()


def test_queue_bound_counts_sequences(keyed_server: RemoteServer) -> None:
    """Two sequences run at once and at most four wait: a request whose n sequences would make more
    wait gets 503, and one whose n can never fit gets 400, never hundreds of queued sequences."""
    srv = keyed_server
    for n in (300, 3):  # above max_num_seqs (2)
        _assert_error(srv.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "n": n}), 400, "n")
    body = {"prompt": "Count:", "ignore_eos": True}
    running = Stream(srv, {**body, "n": 2, "max_tokens": 400})
    assert running.first.wait(60), running.status
    waiting = [Stream(srv, {**body, "n": 1, "max_tokens": 2})]
    srv.wait_for_metrics(lambda s: s["pagedllm:num_requests_waiting"] == 1, timeout=20)
    waiting.append(Stream(srv, {**body, "n": 2, "max_tokens": 2}))
    samples = srv.wait_for_metrics(lambda s: s["pagedllm:num_requests_waiting"] == 3, timeout=20)
    assert samples["pagedllm:num_requests_waiting"] == 3 and running.job.alive()
    # 3 waiting + 2 > 4: refused, though fewer than 4 sequences wait.
    full = srv.post("/v1/completions", json={**body, "n": 2, "max_tokens": 1})
    assert _assert_error(full, 503, None)["code"] == "queue_full"
    assert srv.metrics()["pagedllm:num_requests_waiting"] == 3
    # 3 + 1 = 4 fits.
    last = InThread(lambda: srv.post("/v1/completions", json={**body, "n": 1, "max_tokens": 1}))
    samples = srv.wait_for_metrics(lambda s: s["pagedllm:num_requests_waiting"] == 4, timeout=20)
    assert samples["pagedllm:num_requests_waiting"] == 4
    running.stop.set()  # the client goes away: the long request is aborted and the queue drains
    running.job.join()
    for stream in waiting:
        stream.job.join()
        assert stream.status == 200 and stream.chunks >= 1
    assert last.join().status_code == 200
    srv.wait_idle()


def test_n_above_the_queue_bound_is_refused() -> None:
    """n above --max-queued-requests could never be queued: 400 naming n (not a 503 to retry)."""
    from pagedllm.entrypoints.openai.errors import OpenAIError
    from pagedllm.entrypoints.openai.limits import RequestLimits
    from pagedllm.entrypoints.openai.protocol import CompletionRequest

    limits = RequestLimits().resolve(max_model_len=64, vocab_size=256, max_num_seqs=8)
    limits.check_sampling(CompletionRequest(prompt="x", n=4), max_queued=4)
    limits.check_sampling(CompletionRequest(prompt="x", n=8), max_queued=None)
    for n, queued, bound in ((5, 4, "--max-queued-requests"), (9, None, "max_num_seqs")):
        with pytest.raises(OpenAIError) as exc:
            limits.check_sampling(CompletionRequest(prompt="x", n=n), max_queued=queued)
        assert exc.value.param == "n" and exc.value.status_code == 400 and bound in exc.value.message


# ================================================================================================
# 3. Chat templates sent by clients
# ================================================================================================


def test_request_chat_templates_need_trust(keyed_server: RemoteServer) -> None:
    srv = keyed_server
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    for path, extra, param in (
        ("/v1/chat/completions", {"chat_template": template}, "chat_template"),
        (
            "/v1/chat/completions",
            {"chat_template_kwargs": {"chat_template": template}},
            "chat_template_kwargs",
        ),
        ("/tokenize", {"chat_template": template}, "chat_template"),
        ("/tokenize", {"chat_template_kwargs": {"chat_template": template}}, "chat_template_kwargs"),
    ):
        body = {"messages": USER, **extra} | ({"max_tokens": 1} if path != "/tokenize" else {})
        err = _assert_error(srv.post(path, json=body), 400, param)
        assert "--trust-request-chat-template" in err["message"]
    # The model's own template still renders.
    assert srv.post("/tokenize", json={"messages": USER}).json()["count"] > 0
    srv.wait_idle()


def test_trusted_templates_are_sandboxed_and_bounded(server: RemoteServer) -> None:
    own = server.post("/tokenize", json={"messages": USER, "chat_template": "<{{ messages[0].content }}>"})
    assert own.status_code == 200, own.text
    plain = server.post("/tokenize", json={"prompt": "<Hi>", "add_special_tokens": False}).json()
    assert own.json()["tokens"] == plain["tokens"]
    kwargs = {"chat_template_kwargs": {"chat_template": "{{ messages[0].content }}{{ eos_token }}"}}
    body = {"messages": USER, "max_tokens": 2, "ignore_eos": True, **kwargs}
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    for template in (
        "{{ 'x ' * 5000000 }}",  # one huge value
        "{% for i in range(100000) %}xxxxxxxx{% endfor %}",  # output over the bound
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "{{ 'x'|center(1000000000) }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # the sandbox
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "{% for x in messages %}",  # a syntax error
    ):
        started = time.monotonic()
        r = server.post(
            "/v1/chat/completions", json={"messages": USER, "max_tokens": 1, "chat_template": template}
        )
        _assert_error(r, 400, "messages")
        assert time.monotonic() - started < 5, template

    # A template that loops for ever is stopped by the time limit (1 s here) while other clients
    # are served as usual.
    forever = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    started = time.monotonic()
    slow = InThread(
        lambda: server.post(
            "/v1/chat/completions", json={"messages": USER, "max_tokens": 1, "chat_template": forever}
        )
    )
    other = server.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert other.status_code == 200, other.text
    worst, polls = _max_latency_while(server, slow.alive)
    err = _assert_error(slow.join(), 400, "messages")
    assert "longer than 1 s" in err["message"]
    assert 0.9 < time.monotonic() - started < 10
    # Rendered on the event loop, the template would hold every poll for its whole 1 s limit; the
    # bound stays under that (a busy neighbour made a poll take 0.53 s).
    assert polls >= 3 and worst < 0.9, (worst, polls)
    server.wait_idle()


# ================================================================================================
# 4. Large inputs: limits before tokenizing, tokenization off the event loop
# ================================================================================================


def test_input_limits(server: RemoteServer) -> None:
    big = "hello " * 1_700_000  # 10 MB: refused from its size, not after tokenizing it
    for path, body, param in (
        ("/v1/completions", {"prompt": big, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": ["Hi", big], "max_tokens": 1}, "prompt"),
        ("/tokenize", {"prompt": big}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 20_000}, "messages"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": big}]}]},
            "messages",
        ),
    ):
        started = time.monotonic()
        err = _assert_error(server.post(path, json=body), 400, param)
        assert f"{PROMPT_BYTES} bytes" in err["message"], err
        assert time.monotonic() - started < 3
    # Just under the byte limit passes it (and then fails the context length, after tokenizing).
    r = server.post("/v1/completions", json={"prompt": "x" * PROMPT_BYTES, "max_tokens": 1})
    assert _assert_error(r, 400, "prompt")["code"] == "context_length_exceeded" and "tokens" in r.text
    for body, param in (
        ({"stop": ["s"] * 65}, "stop"),
        ({"stop": "s" * 1025}, "stop"),
        ({"stop_token_ids": [1] * 65}, "stop_token_ids"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
        ({"allowed_token_ids": list(range(49152)) + [0]}, "allowed_token_ids"),
        ({"bad_words": ["w"] * 65}, "bad_words"),
        ({"bad_words": ["w" * 1025]}, "bad_words"),
    ):
        _assert_error(
            server.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, **body}), 400, param
        )
    # A lone surrogate (valid JSON, not text a tokenizer takes): a 400, not a 500.
    surrogate = _post_raw(server, "/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 1}')
    _assert_error(surrogate, 400, "prompt")
    ok = {
        "stop": ["s" * 1024] * 64,
        "logit_bias": {str(i): 0 for i in range(1024)},
        "bad_words": ["zzzq"] * 64,
    }
    assert server.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, **ok}).status_code == 200
    server.wait_idle()


def test_tokenization_runs_off_the_event_loop(server: RemoteServer) -> None:
    """300 prompts of 30 kB (seconds of tokenizing) delay no other client."""
    words = " ".join(f"w{i % 997}x{i % 13}" for i in range(5000))[:30_000]
    prompts = [f"{i} {words}" for i in range(300)]
    job = InThread(
        lambda: server.post("/v1/completions", json={"prompt": prompts, "max_tokens": 1}, timeout=120)
    )
    worst, polls = _max_latency_while(server, job.alive, "/v1/models")
    r = job.join()
    assert _assert_error(r, 400, "prompt")["code"] == "context_length_exceeded"
    # On the event loop, tokenizing them held every other client for seconds.
    assert polls >= 2 and worst < 0.9, (worst, polls)
    server.wait_idle()


# ================================================================================================
# 5. The API key on every route, --metrics-without-auth, --disable-fastapi-docs
# ================================================================================================


def test_every_route_but_health_needs_the_key(keyed_server: RemoteServer) -> None:
    srv = keyed_server
    gets = ["/v1/models", "/metrics", "/version", "/docs", "/redoc", "/openapi.json", "/no-such-route"]
    posts = ["/tokenize", "/detokenize", "/v1/completions", "/v1/chat/completions"]
    for method, path in [("GET", p) for p in gets] + [("POST", p) for p in posts]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            r = httpx.request(method, srv.url(path), headers=headers, json={} if method == "POST" else None)
            assert _assert_error(r, 401, None)["code"] == "invalid_api_key", (method, path)
            assert r.headers["www-authenticate"] == "Bearer"
    for path in gets:
        assert srv.get(path).status_code == (404 if path == "/no-such-route" else 200), path
    assert httpx.get(srv.url("/health")).status_code == 200
    assert srv.post("/tokenize", json={"prompt": "Hi"}).status_code == 200
    assert srv.post("/detokenize", json={"tokens": [1, 2]}).status_code == 200
    srv.wait_idle()


def test_metrics_without_auth_and_disabled_docs() -> None:
    from fastapi.testclient import TestClient

    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.engine.observe.metrics import EngineMetrics
    from pagedllm.entrypoints.openai.api_server import ServerSettings, add_cli_args, build_app
    from pagedllm.entrypoints.openai.cli_args import settings_from_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    flags = ["--api-key", API_KEY, "--metrics-without-auth", "--disable-fastapi-docs"]
    settings = settings_from_args(parser.parse_args(flags), "idle", 20)
    assert settings.metrics_without_auth and settings.disable_fastapi_docs
    assert not settings.trust_request_chat_template
    defaults = settings_from_args(parser.parse_args([]), "idle", 20)
    assert not (defaults.api_keys or defaults.metrics_without_auth or defaults.disable_fastapi_docs)
    limits = defaults.limits
    assert (limits.max_stop_strings, limits.max_stop_string_chars, limits.max_logit_bias) == (64, 1024, 1024)

    key = {"Authorization": f"Bearer {API_KEY}"}
    for docs_off in (False, True):
        settings = ServerSettings(
            served_model_names=["idle"],
            api_keys=(API_KEY,),
            metrics_without_auth=True,
            disable_fastapi_docs=docs_off,
        )
        engine = AsyncLLMEngine(IdleEngine(), metrics=EngineMetrics("idle"))  # type: ignore[arg-type]
        with TestClient(build_app(engine, settings, engine.metrics)) as http:
            metrics = http.get("/metrics")
            assert metrics.status_code == 200 and "pagedllm:num_requests_running" in parse_metrics(
                metrics.text
            )
            assert http.get("/version").status_code == 401 and http.get("/v1/models").status_code == 401
            for path in ("/docs", "/redoc", "/openapi.json"):
                assert http.get(path).status_code == 401
                r = http.get(path, headers=key)
                if docs_off:
                    _assert_error(r, 404, None)
                else:
                    assert r.status_code == 200


# ================================================================================================
# 6. The API document and 405
# ================================================================================================


def test_openapi_documents_400_errors(server: RemoteServer) -> None:
    doc = server.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas
    assert set(schemas["ErrorResponse"]["properties"]) == {"error"}
    assert set(schemas["ErrorInfo"]["properties"]) == {"message", "type", "param", "code"}
    with_body = set()
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            assert "422" not in op["responses"], (method, path)
            if "requestBody" in op:
                with_body.add(path)
                ref = op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
                assert ref == "#/components/schemas/ErrorResponse", (method, path)
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= with_body
    # And the server does answer a validation error with 400 and that object.
    _assert_error(server.post("/v1/completions", json={"prompt": "Hi", "n": "many"}), 400, "n")
    server.wait_idle()


def test_method_not_allowed_keeps_allow_header(server: RemoteServer) -> None:
    for method, path, allowed in (
        ("PUT", "/v1/completions", "POST"),
        ("GET", "/v1/chat/completions", "POST"),
        ("GET", "/tokenize", "POST"),
        ("POST", "/v1/models", "GET"),
        ("DELETE", "/health", "GET"),
    ):
        r = httpx.request(method, server.url(path), timeout=10)
        assert _assert_error(r, 405, None)["code"] == "method_not_allowed"
        assert allowed in r.headers["allow"], (method, path, r.headers)
    server.wait_idle()


def test_client_request_ids_are_echoed_and_never_collide(server: RemoteServer) -> None:
    """A request "X" with n = 2 and a request "0_X" (whose id equals X's first sequence's), and the
    same id from two clients at once: all are served, each response echoes its client's id."""

    def chat(body: dict[str, Any], out: list[httpx.Response]) -> None:
        out.append(server.post("/v1/chat/completions", json={"model": MODEL, **body}, timeout=120))

    story = {
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "n": 2,
        "max_tokens": 40,
        "ignore_eos": True,
        "request_id": "X",
    }
    bodies = [
        story,
        {"messages": USER, "max_tokens": 10, "request_id": "0_X"},
        {"messages": USER, "max_tokens": 10, "request_id": "same"},
        {"messages": USER, "max_tokens": 12, "request_id": "same"},
    ]
    results: list[list[httpx.Response]] = [[] for _ in bodies]
    threads = [threading.Thread(target=chat, args=(b, r)) for b, r in zip(bodies, results, strict=True)]
    threads[0].start()
    time.sleep(0.5)  # X is running when the others arrive
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(timeout=120)
    responses = [r[0] for r in results]
    assert [r.status_code for r in responses] == [200, 200, 200, 200], [r.text for r in responses]
    assert [r.json()["id"] for r in responses] == ["X", "0_X", "same", "same"]
    assert len(responses[0].json()["choices"]) == 2
    assert server.get("/health").status_code == 200
    server.wait_idle()
