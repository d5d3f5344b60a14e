"""A stopped engine core (SIGSTOP: alive but silent, like a hung or starved process), end to end
against real ``pagedllm serve`` processes with a short ``--engine-liveness-timeout``.

1. A stop shorter than the timeout: ``/health`` says 503 (``engine_unresponsive``, naming the core)
   once the core has been silent for 2 s, and 200 again once it runs; the stream in flight
   completes; the server and its core live on.
2. The only core left stopped: ``/health`` says 503 after half the timeout (before anything fails),
   the stream fails at the timeout naming the core, the server exits 1 about a second later, and no
   process of its tree is left (the stopped core is killed).
3. Data parallel, one of two cores stopped: ``/health`` says 503 while it is silent, a new request
   meanwhile is served by the other core, the stopped core's stream fails at the timeout while the
   other's streams on, then ``/health`` is 200 again, the stopped core is gone and the server serves
   on the core left.

Also: the flag's bounds. Every wait is bounded; a stopped core is resumed and killed in cleanup, and
no process of any tree outlives its test.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.processes import alive, describe, wait_gone
from helpers.server import SMALL_ENGINE_ARGS, RemoteServer, assert_serve_flags
from helpers.sse_stream import SSEStream, completion_body
from pagedllm.engine.proc.liveness import unresponsive_after

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CORE_MODULE = "pagedllm.engine.proc.core_process"
# The liveness timeout of the servers whose core dies: short, far above the heartbeats' 0.2 s.
DEATH_TIMEOUT_S = 3.0
# The server of the short stop: stopped for SHORT_STOP_S, past the 2 s after which /health says 503
# and well below its timeout.
SHORT_TIMEOUT_S, SHORT_STOP_S = 6.0, 3.5
# Its stream: long enough to be stopped mid-way, short enough to finish soon on a loaded machine.
SHORT_STREAM_TOKENS = 64
DP_TIMEOUT_S = 3.0
# Slack for a busy machine on top of each deadline (before the liveness flag, a stopped core was
# taken for dead after a fixed 5 s, and the server exited about 10 s after that).
SLACK_S = 2.5
# The documented exit: about a second after the engine is taken for dead (seconds at most).
EXIT_AFTER_DEATH_S = 5.0


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------


def _cores(srv: RemoteServer) -> dict[int, psutil.Process]:
    """The engine-core processes of ``srv`` by rank (children of the server, read from their JSON
    argument)."""
    cores = {}
    for proc in psutil.Process(srv.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmdline = proc.cmdline()
            if CORE_MODULE in cmdline:
                cores[int(json.loads(cmdline[-1])["options"]["rank"])] = proc
    return cores


@contextlib.contextmanager
def _server(args: list[str]) -> Iterator[tuple[RemoteServer, list[psutil.Process]]]:
    """A server and its process tree; on the way out every stopped process is resumed, the server
    stopped, and the whole tree asserted gone."""
    srv = RemoteServer([*SMALL_ENGINE_ARGS, "--shutdown-timeout", "5", *args])
    srv.start()
    tree = psutil.Process(srv.pid).children(recursive=True)
    try:
        yield srv, tree
    finally:
        for proc in tree:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGCONT)
        srv.stop()
        for proc in tree:
            with contextlib.suppress(psutil.Error):
                if alive(proc):
                    proc.kill()
        wait_gone(tree, what="left running after the test")


class Stream(SSEStream):
    def __init__(self, srv: RemoteServer, prompt: str, max_tokens: int) -> None:
        super().__init__(srv, completion_body(prompt, max_tokens))

    def assert_failed(self, core: int) -> dict[str, Any]:
        """The stream ended with an error event naming ``core``'s death, then ``[DONE]``."""
        error = self.assert_failed_with_error_event()
        assert error["code"] == "engine_dead" and f"engine core {core} died" in error["message"], self
        return error


def _health(srv: RemoteServer) -> tuple[int, dict[str, Any] | None]:
    r = srv.get("/health", timeout=5)
    return r.status_code, (r.json()["error"] if r.status_code != 200 else None)


def _running_by_engine(srv: RemoteServer) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(srv.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "pagedllm:num_requests_running" and "engine" in sample.labels:
                out[sample.labels["engine"]] = float(sample.value)
    return out


def _stop(proc: psutil.Process) -> float:
    proc.send_signal(signal.SIGSTOP)
    return time.monotonic()


# ------------------------------------------------------------------------------------------------
# 1. A short stop
# ------------------------------------------------------------------------------------------------


def test_short_stop_turns_health_503_then_200_and_kills_nothing() -> None:
    with _server(["--engine-liveness-timeout", str(SHORT_TIMEOUT_S)]) as (srv, tree):
        core = _cores(srv)[0]
        stream = Stream(srv, "Count:", SHORT_STREAM_TOKENS).start()
        stream.wait_first()
        stopped = _stop(core)
        seen: list[tuple[float, int, dict[str, Any] | None]] = []
        while time.monotonic() - stopped < SHORT_STOP_S:
            status, error = _health(srv)
            seen.append((time.monotonic() - stopped, status, error))
            time.sleep(0.05)
        core.send_signal(signal.SIGCONT)
        resumed = time.monotonic()
        status, error = _health(srv)
        while status != 200 and time.monotonic() - resumed < SLACK_S + 5:
            time.sleep(0.05)
            status, error = _health(srv)
        recovered = time.monotonic() - resumed
        stream.join(120)
        print(
            f"\nshort stop: /health 503 from {min((t for t, s, _ in seen if s == 503), default=None)} s "
            f"after the stop; 200 again {recovered:.2f} s after the resume"
        )
        # While stopped: 503 naming the unresponsive core (after about a second of silence).
        unhealthy = [(t, e) for t, s, e in seen if s == 503]
        assert unhealthy, seen
        first_at, first_error = unhealthy[0]
        # Not before the core missed its heartbeats (the last one came at most 0.3 s before the stop).
        assert first_at >= unresponsive_after(SHORT_TIMEOUT_S) - 0.5, seen
        assert first_error is not None and first_error["code"] == "engine_unresponsive", first_error
        assert "Engine core 0 unresponsive" in first_error["message"], first_error
        assert f"a core silent for {SHORT_TIMEOUT_S:g} s is taken for dead" in first_error["message"], (
            first_error
        )
        assert {s for _, s, _ in seen} <= {200, 503}, seen
        # Running again: healthy, the stream completes, nothing was killed.
        assert status == 200, (status, error)
        assert not stream.exception and stream.error is None and stream.last == "data: [DONE]", stream
        assert stream.usage is not None and stream.usage["completion_tokens"] == SHORT_STREAM_TOKENS, stream
        assert all(alive(p) for p in tree), describe(tree)
        assert srv.proc is not None and srv.proc.poll() is None
        r = srv.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
        assert r.status_code == 200, r.text


# ------------------------------------------------------------------------------------------------
# 2. The only core left stopped
# ------------------------------------------------------------------------------------------------


def test_stopped_core_fails_the_stream_and_the_server_exits_1() -> None:
    with _server(["--engine-liveness-timeout", str(DEATH_TIMEOUT_S)]) as (srv, tree):
        core = _cores(srv)[0]
        stream = Stream(srv, "Count:", 1000).start()
        stream.wait_first()
        stopped = _stop(core)
        health: list[tuple[float, int, dict[str, Any] | None]] = []
        while srv.proc is not None and srv.proc.poll() is None and time.monotonic() - stopped < 30:
            with contextlib.suppress(httpx.TransportError):
                status, error = _health(srv)
                health.append((time.monotonic() - stopped, status, error))
            time.sleep(0.05)
        exited = time.monotonic()
        code = srv.wait(5)
        stream.join(10)
        failed = stream.ended - stopped
        first_503 = next((t for t, s, _ in health if s == 503), None)
        print(
            f"\nstopped core: /health 503 {first_503} s after the stop; the stream failed after "
            f"{failed:.2f} s; the server exited {exited - stream.ended:.2f} s after that, status {code}"
        )
        # /health: 503 about a second after the stop, before anything failed.
        assert first_503 is not None and first_503 < stream.ended - stopped, health
        assert first_503 < unresponsive_after(DEATH_TIMEOUT_S) + SLACK_S, health
        unresponsive = [e for _, s, e in health if s == 503 and e and e["code"] == "engine_unresponsive"]
        assert unresponsive and "Engine core 0 unresponsive" in unresponsive[0]["message"], health
        # The stream: an error event naming the core, at the liveness timeout (not before).
        error = stream.assert_failed(0)
        assert f"--engine-liveness-timeout {DEATH_TIMEOUT_S:g}" in error["message"], error
        assert DEATH_TIMEOUT_S - 0.5 <= failed < DEATH_TIMEOUT_S + SLACK_S, failed
        # The server: 503 engine_dead once the core is taken for dead, exit 1 about a second later,
        # with the stopped core killed and nothing of its tree left.
        dead = [e for t, s, e in health if s == 503 and e and e["code"] == "engine_dead"]
        assert all("engine core 0 died" in e["message"] for e in dead), dead
        assert code == 1, srv.log_tail()
        assert exited - stream.ended < EXIT_AFTER_DEATH_S, (exited - stream.ended, srv.log_tail())
        wait_gone(tree, timeout=5)
        assert "Killing engine core 0" in srv.log_tail(200), srv.log_tail()


# ------------------------------------------------------------------------------------------------
# 3. Data parallel: one core of two stopped
# ------------------------------------------------------------------------------------------------


def test_stopped_core_among_living_fails_its_requests_only() -> None:
    args = ["--data-parallel-size", "2", "--engine-liveness-timeout", str(DP_TIMEOUT_S)]
    with _server(args) as (srv, tree):
        cores = _cores(srv)
        assert sorted(cores) == [0, 1], describe(tree)
        streams = [Stream(srv, f"Item {i}:", 1000).start() for i in range(2)]
        for s in streams:
            s.wait_first()
        deadline = time.monotonic() + 30
        while not all(v >= 1 for v in _running_by_engine(srv).values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sorted(k for k, v in _running_by_engine(srv).items() if v >= 1) == ["0", "1"]
        stopped = _stop(cores[1])
        # /health turns 503 naming core 1; a request sent then is served by core 0.
        status, error = _health(srv)
        while status == 200 and time.monotonic() - stopped < unresponsive_after(DP_TIMEOUT_S) + SLACK_S:
            time.sleep(0.05)
            status, error = _health(srv)
        unhealthy_at = time.monotonic() - stopped
        assert status == 503 and error is not None, (status, error)
        assert error["code"] == "engine_unresponsive" and "Engine core 1 unresponsive" in error["message"], (
            error
        )
        meanwhile = srv.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert meanwhile.status_code == 200, meanwhile.text
        # Core 1's stream fails at the timeout; core 0's streams on.
        deadline = time.monotonic() + DP_TIMEOUT_S + SLACK_S + 5
        while all(s.running() for s in streams) and time.monotonic() < deadline:
            time.sleep(0.05)
        failed = [s for s in streams if not s.running()]
        living = [s for s in streams if s.running()]
        assert len(failed) == 1 and len(living) == 1, streams
        failed[0].assert_failed(1)
        assert DP_TIMEOUT_S - 0.5 <= failed[0].ended - stopped < DP_TIMEOUT_S + SLACK_S, failed[0]
        at_failure = living[0].chunks
        # Healthy again once core 1 is taken for dead (and killed); the server serves on core 0.
        status, error = _health(srv)
        while status != 200 and time.monotonic() - failed[0].ended < SLACK_S + 5:
            time.sleep(0.05)
            status, error = _health(srv)
        assert status == 200, (status, error)
        wait_gone([cores[1]], timeout=5, what="the stopped core was not killed")
        r = srv.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 60
        while living[0].chunks < at_failure + 3 and living[0].running() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert living[0].chunks >= at_failure + 3 and living[0].error is None, living[0]
        assert alive(cores[0]) and srv.proc is not None and srv.proc.poll() is None
        living[0].stop.set()
        living[0].join(30)
        print(
            f"\ndata parallel: /health 503 {unhealthy_at:.2f} s after the stop; core 1's stream failed "
            f"after {failed[0].ended - stopped:.2f} s; core 0 streamed on"
        )


# ------------------------------------------------------------------------------------------------
# The flag
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (["--engine-liveness-timeout", "0.5"], "--engine-liveness-timeout must be at least 1 s"),
        (["--engine-liveness-timeout", "nan"], "--engine-liveness-timeout must be at least 1 s"),
        (["--engine-liveness-timeout", "3", "--no-multiprocess"], "--engine-liveness-timeout applies to"),
        (["--engine-liveness-timeout", "3"], None),
        ([], None),
    ],
)
def test_liveness_timeout_flag(flags: list[str], problem: str | None) -> None:
    assert_serve_flags(flags, problem)
