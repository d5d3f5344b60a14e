"""``pagedllm serve`` as a tree of processes (engine cores, HTTP front-ends, headless machines), end
to end against real servers.

1. ``--api-server-count 2``: completions and a streamed chat through both front-ends give the greedy
   outputs of an in-process ``LLM``; SIGTERM lets a stream in flight finish, then takes the whole
   tree down.
2. ``--data-parallel-size 2``: the same greedy outputs; a group of prompts sharing a long prefix all
   go to one core; cut connections free both cores' KV blocks; a core killed with SIGKILL fails only
   its own requests, the other core keeps serving, and the dead core's gauges read 0.
3. The only core killed: its stream fails, /health says so, the server exits non-zero.
4. An exception in a forward (``PAGEDLLM_INJECT_FAULT_AT_STEP``): the request fails naming it, the
   server exits non-zero.
5. A model that does not exist: the server exits non-zero saying so.
6. A headless machine whose core joins a front-end's: both cores serve, both trees stop on SIGTERM.
7. SIGTERM with a stream in flight: the stream completes, then the server exits 0.

No process of any tree outlives its test. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.processes import alive, describe, wait_gone
from helpers.prompts import REFERENCE_PROMPTS
from helpers.server import IDLE_GAUGES, REPO_ROOT, SMALL_ENGINE_ARGS, RemoteServer, free_port
from helpers.sse_stream import SSEStream, completion_body
from pagedllm.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = REFERENCE_PROMPTS[:4]
MAX_TOKENS = 12
CHAT = [{"role": "user", "content": "Name three colours."}]
# ~300 tokens shared by the prompts of the routing check (the default model's tokenizer).
LONG_PREFIX = " ".join(f"Sentence {i} is about the colour of item {i}." for i in range(22))
CORE_MODULE = "pagedllm.engine.proc.core_process"
FAIL_WITHIN_S = 3.0  # a request on a core that died ends this soon after the core
EXIT_WITHIN_S = 10.0  # a server whose engine died exits this soon
STOP_WITHIN_S = 180.0  # a server told to stop (SIGTERM) exits this soon
# Long enough for a stream to finish after SIGTERM on a busy two-core machine.
DRAIN_ARGS = ["--shutdown-timeout", "150"]


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _serve_process(args: list[str]) -> Iterator[tuple[subprocess.Popen[bytes], Callable[[], str]]]:
    """``pagedllm serve ARGS`` with its output in a temporary file, and a function that reads that
    output; the process is killed on the way out if it still runs."""
    cmd = [sys.executable, "-m", "pagedllm", "serve", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO_ROOT)}
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        text: list[str] = []

        def read() -> str:
            return text[0] if text else ""

        try:
            yield proc, read
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            log.seek(0)
            text.append(log.read().decode(errors="replace"))


def _tree(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _cores(pid: int) -> dict[int, psutil.Process]:
    """The engine-core processes under ``pid``, by rank (read from their JSON argument)."""
    cores = {}
    for proc in _tree(pid):
        try:
            cmdline = proc.cmdline()
        except psutil.Error:
            continue
        if CORE_MODULE in cmdline:
            spec = json.loads(cmdline[-1])
            cores[int(spec["options"]["rank"])] = proc
    return cores


def _frontends(pid: int) -> list[psutil.Process]:
    """The HTTP front-end processes of a server with ``--api-server-count`` > 1."""
    return [p for p in _tree(pid) if any("spawn_main" in part for part in p.cmdline())]


def _by_engine(srv: RemoteServer) -> dict[str, dict[str, float]]:
    """``/metrics`` samples carrying an ``engine`` label: engine -> sample name -> value."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(srv.get("/metrics").text):
        for sample in family.samples:
            engine = sample.labels.get("engine")
            if engine is not None:
                out.setdefault(engine, {})[sample.name] = float(sample.value)
    return out


def _wait_engines(
    srv: RemoteServer, condition: Callable[[dict[str, dict[str, float]]], bool], timeout: float = 10.0
) -> dict[str, dict[str, float]]:
    deadline = time.monotonic() + timeout
    samples = _by_engine(srv)
    while not condition(samples) and time.monotonic() < deadline:
        time.sleep(0.2)
        samples = _by_engine(srv)
    return samples


def _wait_idle_engines(srv: RemoteServer, engines: tuple[str, ...], timeout: float = 10.0) -> None:
    """Each of ``engines`` runs and queues nothing and holds no KV block."""

    def idle(s: dict[str, dict[str, float]]) -> bool:
        return all(s.get(e, {}).get(name) == 0 for e in engines for name in IDLE_GAUGES)

    samples = _wait_engines(srv, idle, timeout)
    assert idle(samples), {e: {n: samples.get(e, {}).get(n) for n in IDLE_GAUGES} for e in engines}


def _alive_engines(srv: RemoteServer) -> float:
    return float(srv.metrics()["pagedllm:num_engines_alive"])


def _token_texts(token_ids: list[int], tokenizer: Any) -> list[str]:
    return [str(tokenizer.decode([t])) for t in token_ids]


def _completion(client: openai.OpenAI, prompt: str) -> tuple[str, list[str]]:
    """A greedy completion of ``prompt``: its text and its tokens (as the logprobs name them)."""
    resp = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    choice = resp.choices[0]
    assert resp.usage is not None and resp.usage.completion_tokens == MAX_TOKENS, resp.usage
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    return choice.text, list(choice.logprobs.tokens)


def _assert_greedy_outputs(srv: RemoteServer, reference: dict[str, tuple[str, list[str]]]) -> None:
    """Each prompt twice, all at once: the reference's text and tokens every time."""
    client = srv.client()
    with ThreadPoolExecutor(2 * len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: _completion(client, p), PROMPTS * 2))
    for prompt, got in zip(PROMPTS * 2, results, strict=True):
        assert got == reference[prompt], prompt


def _free_port_pair() -> int:
    """A port P with P and P + 1 both free now."""
    for _ in range(50):
        port = free_port()
        with contextlib.suppress(OSError), socket.socket() as s:
            s.bind(("127.0.0.1", port + 1))
            return port
    raise RuntimeError("no two consecutive free ports")


class Stream(SSEStream):
    def assert_failed(self, since: float, *, within: float = FAIL_WITHIN_S) -> dict[str, Any]:
        """The stream ended with an error event then ``[DONE]``, at most ``within`` s after ``since``."""
        error = self.assert_failed_with_error_event()
        assert self.ended - since < within, (self.ended - since, self)
        return error


def _wait_first(streams: list[Stream], timeout: float = 120.0) -> None:
    for s in streams:
        assert s.first.wait(timeout), "no chunk came"
        assert s.chunks > 0, s


def _sigterm_while_streaming(srv: RemoteServer, stream: Stream) -> None:
    """SIGTERM the server; it starts draining (/health 503) while ``stream`` is still open."""
    srv.terminate()
    deadline = time.monotonic() + 10
    status = 200
    while status != 503 and time.monotonic() < deadline:
        time.sleep(0.05)
        with contextlib.suppress(httpx.TransportError):
            status = srv.get("/health", timeout=2).status_code
    assert status == 503, status
    assert stream.thread is not None and stream.thread.is_alive(), (
        f"the stream ended before the drain: {stream}"
    )


# ------------------------------------------------------------------------------------------------
# The in-process reference
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(make_llm: Callable[..., Any]) -> dict[str, tuple[str, list[str]]]:
    """The greedy text and tokens of each prompt from an in-process ``LLM`` with the servers'
    engine arguments."""
    llm = make_llm(max_model_len=1024, num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokenizer = llm.llm_engine.tokenizer
    return {
        p: (o.outputs[0].text, _token_texts(list(o.outputs[0].token_ids), tokenizer))
        for p, o in zip(PROMPTS, outs, strict=True)
    }


# ------------------------------------------------------------------------------------------------
# 1. Two HTTP front-ends over one core
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_frontends() -> Iterator[RemoteServer]:
    with RemoteServer([*SMALL_ENGINE_ARGS, *DRAIN_ARGS, "--api-server-count", "2"]) as srv:
        yield srv


def _connections_by_frontend(srv: RemoteServer, count: int) -> dict[int, httpx.Client]:
    """One kept-alive client connection held by each of ``count`` front-ends: new connections are
    opened until every front-end has accepted one (which process accepts is the kernel's choice)."""
    me = psutil.Process()
    frontends = _frontends(srv.pid)

    def local_ports() -> set[int]:
        return {c.laddr.port for c in me.net_connections("tcp") if c.raddr and c.raddr.port == srv.port}

    held: dict[int, httpx.Client] = {}
    spare: list[httpx.Client] = []
    try:
        for _ in range(60):
            before = local_ports()
            client = httpx.Client(base_url=srv.base_url, headers=srv.headers(), timeout=120.0)
            assert client.get("/health").status_code == 200
            (port,) = local_ports() - before
            owner = next(
                p.pid
                for p in frontends
                if any(c.raddr and c.raddr.port == port for c in p.net_connections("tcp"))
            )
            if owner in held:
                spare.append(client)
                continue
            held[owner] = client
            if len(held) == count:
                return held
        raise AssertionError(f"60 connections all went to the front-ends {list(held)}")
    finally:
        for client in spare:
            client.close()


def test_a_response_stored_through_one_front_end_is_found_through_the_other(
    two_frontends: RemoteServer,
) -> None:
    srv = two_frontends
    first, second = _connections_by_frontend(srv, 2).values()
    try:
        body = {"input": "What is the capital of France?", "max_output_tokens": 12, "temperature": 0}
        created = first.post("/v1/responses", json=body).json()
        assert second.get(f"/v1/responses/{created['id']}").json() == created
        follow = {"input": "And of Italy?", "previous_response_id": created["id"], "max_output_tokens": 12}
        continued = second.post("/v1/responses", json={**follow, "temperature": 0}).json()
        assert continued["previous_response_id"] == created["id"], continued
        items = first.get(f"/v1/responses/{continued['id']}/input_items?order=asc").json()["data"]
        assert [item["role"] for item in items] == ["user", "assistant", "user"]
        # A background response started through one front-end, cancelled through the other: the
        # front-end running it sees the cancel in the store and stops it.
        counting = {"input": "Count from 1 to 1000, separated by commas.", "max_output_tokens": 900}
        generated = srv.wait_idle()["pagedllm:generation_tokens_total"]
        running = first.post("/v1/responses", json={**counting, "background": True}).json()
        deadline = time.monotonic() + 60
        while second.get(f"/v1/responses/{running['id']}").json()["status"] == "queued":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert second.post(f"/v1/responses/{running['id']}/cancel").json()["status"] == "cancelled"
        assert srv.wait_idle(timeout=30)["pagedllm:generation_tokens_total"] - generated < 900
        assert first.delete(f"/v1/responses/{created['id']}").json()["deleted"] is True
        assert second.get(f"/v1/responses/{created['id']}").status_code == 404
    finally:
        first.close()
        second.close()


def test_two_front_ends_serve_greedy_outputs_and_stop_together(
    two_frontends: RemoteServer, reference: dict[str, tuple[str, list[str]]]
) -> None:
    srv = two_frontends
    assert srv.get("/health").status_code == 200
    models = srv.get("/v1/models")
    assert models.status_code == 200 and models.json()["data"][0]["id"], models.text
    frontends = _frontends(srv.pid)
    assert len(frontends) == 2 and len(_cores(srv.pid)) == 1, describe(_tree(srv.pid))

    # Eight streams at once (six completions, two chats), each held after its first chunk so that
    # every connection is open at the same time: both front-ends hold some of them.
    hold = threading.Event()
    completions = [
        Stream(srv, completion_body(PROMPTS[i % len(PROMPTS)], MAX_TOKENS), hold=hold).start()
        for i in range(6)
    ]
    chat_body = {"messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    chats = [Stream(srv, chat_body, "/v1/chat/completions", hold=hold).start() for _ in range(2)]
    try:
        _wait_first([*completions, *chats])
        held = {
            p.pid: sum(
                1
                for c in p.net_connections("tcp")
                if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == srv.port
            )
            for p in frontends
        }
    finally:
        hold.set()
    for s in [*completions, *chats]:
        s.join()
    assert sum(held.values()) == 8 and all(held.values()), held
    for i, s in enumerate(completions):
        s.assert_completed(MAX_TOKENS)
        assert s.text == reference[PROMPTS[i % len(PROMPTS)]][0], i
    for s in chats:
        assert not s.exception and s.error is None and s.last == "data: [DONE]", s
        assert s.text and s.finish_reason in ("stop", "length"), s
    assert chats[0].text == chats[1].text

    # Non-streamed: the reference's tokens, and the streamed chat's text.
    _assert_greedy_outputs(srv, reference)
    chat = srv.client().chat.completions.create(
        model=models.json()["data"][0]["id"],
        messages=CHAT,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert chat.choices[0].message.content == chats[0].text
    srv.wait_idle()

    # SIGTERM with a stream in flight on one of the front-ends: the stream completes (the other
    # front-end's stopping does not stop the shared core), then the whole tree exits 0.
    tree = _tree(srv.pid)
    stream = Stream(srv, completion_body(PROMPTS[0], 32)).start()
    _wait_first([stream])
    _sigterm_while_streaming(srv, stream)
    stream.join()
    code = srv.wait(STOP_WITHIN_S)
    wait_gone(tree)
    stream.assert_completed(32)
    assert code == 0, srv.log_tail()


# ------------------------------------------------------------------------------------------------
# 2. Two engine cores (data parallel)
# ------------------------------------------------------------------------------------------------

ENGINES = ("0", "1")


@pytest.fixture(scope="module")
def dp2() -> Iterator[RemoteServer]:
    with RemoteServer([*SMALL_ENGINE_ARGS, "--data-parallel-size", "2"]) as srv:
        yield srv


def test_data_parallel_greedy_outputs(dp2: RemoteServer, reference: dict[str, tuple[str, list[str]]]) -> None:
    before = _by_engine(dp2)
    _assert_greedy_outputs(dp2, reference)
    after = _wait_engines(
        dp2,
        lambda s: (
            sum(s[e]["pagedllm:generation_tokens_total"] for e in ENGINES)
            - sum(before[e]["pagedllm:generation_tokens_total"] for e in ENGINES)
            >= 2 * len(PROMPTS) * MAX_TOKENS
        ),
    )
    # Both cores served some of the eight.
    for e in ENGINES:
        assert after[e]["pagedllm:generation_tokens_total"] > before[e]["pagedllm:generation_tokens_total"], e
    assert _alive_engines(dp2) == 2
    _wait_idle_engines(dp2, ENGINES)
    dp2.wait_idle()


def test_data_parallel_routes_a_shared_prefix_to_one_core(dp2: RemoteServer) -> None:
    client = dp2.client()
    model = client.models.list().data[0].id
    hits, queries = "pagedllm:prefix_cache_hits_total", "pagedllm:prefix_cache_queries_total"
    before = _by_engine(dp2)
    prompt_tokens = 0
    for i in range(6):
        resp = client.completions.create(
            model=model,
            prompt=f"{LONG_PREFIX} Question {i}: which item is blue?",
            max_tokens=1,
            temperature=0,
        )
        assert resp.usage is not None and resp.usage.prompt_tokens >= 250, resp.usage
        prompt_tokens += resp.usage.prompt_tokens

    def grown(s: dict[str, dict[str, float]], name: str) -> dict[str, float]:
        return {e: s[e][name] - before[e][name] for e in ENGINES}

    after = _wait_engines(dp2, lambda s: sum(grown(s, queries).values()) >= prompt_tokens)
    looked_up, found = grown(after, queries), grown(after, hits)
    assert sum(looked_up.values()) >= prompt_tokens, (looked_up, prompt_tokens)
    # Every request went to one core: only it looked the prompts up, and it found the prefix five
    # times (the first request computed it).
    home = max(ENGINES, key=lambda e: looked_up[e])
    other = next(e for e in ENGINES if e != home)
    assert looked_up[other] == 0 and found[other] == 0, (looked_up, found)
    assert found[home] >= 5 * 256, (looked_up, found)
    _wait_idle_engines(dp2, ENGINES)


def test_data_parallel_cut_connections_free_both_cores(dp2: RemoteServer) -> None:
    with contextlib.ExitStack() as stack:
        http = stack.enter_context(httpx.Client(timeout=60))
        for i in range(4):
            r = stack.enter_context(
                http.stream("POST", dp2.url("/v1/completions"), json=completion_body(f"Story {i}:", 500))
            )
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
        # Two on each core (least loaded first), running.
        running = _wait_engines(
            dp2, lambda s: all(s[e]["pagedllm:num_requests_running"] >= 1 for e in ENGINES)
        )
        assert all(running[e]["pagedllm:num_requests_running"] >= 1 for e in ENGINES), running
        assert all(running[e]["pagedllm:kv_cache_usage_perc"] > 0 for e in ENGINES), running
    # Closing the connections mid-stream aborts the requests on both cores.
    _wait_idle_engines(dp2, ENGINES)
    dp2.wait_idle()
    assert dp2.get("/health").status_code == 200


def test_data_parallel_survives_a_killed_core(
    dp2: RemoteServer, reference: dict[str, tuple[str, list[str]]]
) -> None:
    cores = _cores(dp2.pid)
    assert sorted(cores) == [0, 1], describe(_tree(dp2.pid))
    # Long streams (cut by the test once it has seen enough), two on each core.
    streams = [Stream(dp2, completion_body(f"Item {i}:", 400)).start() for i in range(4)]
    try:
        _wait_first(streams)
        running = _wait_engines(
            dp2, lambda s: all(s[e]["pagedllm:num_requests_running"] >= 1 for e in ENGINES)
        )
        assert all(running[e]["pagedllm:num_requests_running"] >= 1 for e in ENGINES), running

        killed = time.monotonic()
        at_kill = [s.chunks for s in streams]
        cores[1].kill()

        def settled() -> bool:
            # Each stream has ended, or has streamed on past the kill.
            return all(
                not (s.thread is not None and s.thread.is_alive()) or s.chunks >= n + 3
                for s, n in zip(streams, at_kill, strict=True)
            )

        health = []
        while not settled() and time.monotonic() - killed < 120:
            health.append(dp2.get("/health").status_code)
            time.sleep(0.1)
        assert settled(), streams
        health.append(dp2.get("/health").status_code)
    finally:
        for s in streams:
            s.stop.set()
    for s in streams:
        s.join()
    failed = [s for s in streams if s.error is not None]
    served = [s for s in streams if s.error is None]
    # The requests on core 1 fail at once, naming the core; those on core 0 stream on.
    assert failed and served, streams
    for s in failed:
        error = s.assert_failed(killed)
        assert "engine core 1" in error["message"], error
    for s, n in zip(streams, at_kill, strict=True):
        if s.error is None:
            assert not s.exception and s.chunks >= n + 3 and s.finish_reason is None, s
    assert set(health) == {200}, health
    assert _alive_engines(dp2) == 1
    assert cores[0].is_running() and dp2.proc is not None and dp2.proc.poll() is None

    # New requests go to the core left, with the same outputs.
    _assert_greedy_outputs(dp2, reference)
    assert dp2.get("/health").status_code == 200
    _wait_idle_engines(dp2, ("0",))
    # The dead core's series read 0, so the sums over cores read idle.
    dead = _wait_engines(dp2, lambda s: all(s.get("1", {}).get(n, 0) == 0 for n in IDLE_GAUGES), timeout=5)
    assert all(dead.get("1", {}).get(n, 0) == 0 for n in IDLE_GAUGES), dead.get("1")
    dp2.wait_idle(timeout=5)


# ------------------------------------------------------------------------------------------------
# 3-5. A dying engine, a model that does not load
# ------------------------------------------------------------------------------------------------


def test_killed_only_core_fails_the_stream_and_the_server_exits() -> None:
    srv = RemoteServer(SMALL_ENGINE_ARGS)
    srv.start()
    try:
        tree = _tree(srv.pid)
        core = _cores(srv.pid)[0]
        stream = Stream(srv, completion_body("Count:", 300)).start()
        _wait_first([stream])
        killed = time.monotonic()
        core.kill()
        stream.join(30)
        error = stream.assert_failed(killed)
        assert error["type"] == "server_error" and "engine core 0" in error["message"], error
        # /health says the engine is dead while the process is still up (it exits a second later).
        with contextlib.suppress(httpx.TransportError):
            r = srv.get("/health", timeout=2)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
        code = srv.wait(EXIT_WITHIN_S)
        assert code != 0, srv.log_tail()
        wait_gone(tree)
    finally:
        srv.stop()


def test_injected_fault_fails_the_request_and_the_server_exits() -> None:
    srv = RemoteServer(SMALL_ENGINE_ARGS, env={"PAGEDLLM_INJECT_FAULT_AT_STEP": "3"})
    srv.start()
    try:
        tree = _tree(srv.pid)
        assert len(_cores(srv.pid)) == 1, describe(tree)
        r = srv.post(
            "/v1/completions", json={"prompt": "Hi", "max_tokens": 20, "ignore_eos": True}, timeout=60
        )
        assert r.status_code in (500, 503), r.text
        error = r.json()["error"]
        assert error["type"] == "server_error" and "injected fault" in error["message"], error
        code = srv.wait(EXIT_WITHIN_S)
        assert code != 0, srv.log_tail()
        wait_gone(tree)
    finally:
        srv.stop()


def test_missing_model_fails_the_start_and_leaves_nothing() -> None:
    model = f"/nonexistent/{uuid.uuid4().hex}/model.gguf"
    seen: dict[int, psutil.Process] = {}
    with _serve_process([model, "--port", str(free_port()), *SMALL_ENGINE_ARGS]) as (proc, read_output):
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(proc.pid).children(recursive=True):
                    seen.setdefault(child.pid, child)
            time.sleep(0.05)
        code = proc.wait(max(1.0, deadline - time.monotonic()))
    output = read_output()
    assert code != 0, output
    assert "does not exist" in output and model in output, output
    wait_gone(list(seen.values()))
    # Nothing started for this model is left (a core's JSON argument names it).
    left = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if any(model in part for part in p.cmdline()) and alive(p):
                left.append(p)
    assert not left, describe(left)


# ------------------------------------------------------------------------------------------------
# 6. A headless machine
# ------------------------------------------------------------------------------------------------


def test_headless_core_joins_and_both_trees_stop() -> None:
    port = _free_port_pair()
    dp_args = [
        "--data-parallel-size",
        "2",
        "--data-parallel-size-local",
        "1",
        "--data-parallel-address",
        "127.0.0.1",
        "--data-parallel-rpc-port",
        str(port),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO_ROOT)}
    headless_cmd = [
        sys.executable,
        "-m",
        "pagedllm",
        "serve",
        "--headless",
        *dp_args,
        "--data-parallel-start-rank",
        "1",
        *SMALL_ENGINE_ARGS,
    ]
    log = tempfile.NamedTemporaryFile(prefix="pagedllm-headless-", suffix=".log", delete=False)
    headless = subprocess.Popen(headless_cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    srv = RemoteServer([*SMALL_ENGINE_ARGS, *dp_args])
    try:
        srv.start()  # ready once the headless core has joined too
        assert headless.poll() is None
        front_tree, headless_tree = _tree(srv.pid), _tree(headless.pid)
        assert sorted(_cores(srv.pid)) == [0] and sorted(_cores(headless.pid)) == [1]
        assert _alive_engines(srv) == 2

        # Distinct prompts one after another: the least loaded core takes each, in turn.
        client = srv.client()
        model = client.models.list().data[0].id
        generated = "pagedllm:generation_tokens_total"
        for i in range(8):
            resp = client.completions.create(model=model, prompt=f"Fact {i}:", max_tokens=4, temperature=0)
            assert resp.usage is not None and resp.usage.completion_tokens > 0
            s = _wait_engines(srv, lambda s: sum(s[e][generated] for e in ENGINES) > 0)
            if all(s[e][generated] > 0 for e in ENGINES):
                break
        s = _by_engine(srv)
        assert all(s[e][generated] > 0 for e in ENGINES), s
        _wait_idle_engines(srv, ENGINES)

        srv.terminate()
        assert srv.wait(STOP_WITHIN_S) == 0, srv.log_tail()
        # The front-end told the headless core to stop, so the headless machine may be exiting
        # already; otherwise SIGTERM stops it.
        try:
            code = headless.wait(10)
        except subprocess.TimeoutExpired:
            headless.send_signal(signal.SIGTERM)
            code = headless.wait(STOP_WITHIN_S)
        assert code == 0, Path(log.name).read_text(errors="replace")[-4000:]
        wait_gone(front_tree + headless_tree)
    finally:
        srv.stop()
        if headless.poll() is None:
            headless.kill()
            headless.wait(10)
        log.close()
        os.unlink(log.name)


# ------------------------------------------------------------------------------------------------
# 7. SIGTERM drains
# ------------------------------------------------------------------------------------------------


def test_sigterm_lets_the_stream_finish_then_exits_0() -> None:
    with RemoteServer([*SMALL_ENGINE_ARGS, *DRAIN_ARGS]) as srv:
        tree = _tree(srv.pid)
        assert len(_cores(srv.pid)) == 1, describe(tree)
        stream = Stream(srv, completion_body("Once upon a time", 64)).start()
        _wait_first([stream])
        _sigterm_while_streaming(srv, stream)
        stream.join()
        stream.assert_completed(64)
        assert srv.wait(STOP_WITHIN_S) == 0, srv.log_tail()
        wait_gone(tree)


@pytest.mark.parametrize("api_server_count", [1, 2])
def test_sigterm_during_start_up_exits_0_and_leaves_nothing(api_server_count: int) -> None:
    """A server told to stop while it starts stops as asked: exit status 0, every process gone.
    The signal comes as soon as the front-end processes exist (two front-ends: they are still
    importing) or the core does (one front-end: the launcher is importing or waiting for it)."""

    def started(pid: int) -> bool:
        with contextlib.suppress(psutil.Error):
            if api_server_count > 1:
                return len(_frontends(pid)) == api_server_count
            return bool(_cores(pid))
        return False

    args = ["--port", str(free_port()), *SMALL_ENGINE_ARGS, "--api-server-count", str(api_server_count)]
    tree: list[psutil.Process] = []
    code: int | None = None
    with _serve_process(args) as (proc, read_output):
        deadline = time.monotonic() + 120
        while proc.poll() is None and not started(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if proc.poll() is None:
            tree = _tree(proc.pid)
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(STOP_WITHIN_S)
    output = read_output()
    assert tree, f"the server's processes did not start: {output[-4000:]}"
    assert code == 0, output[-4000:]
    wait_gone(tree)
