"""Slow and stalled clients against a real ``pagedllm serve`` process with short read deadlines
(``--request-read-timeout 1.5``, ``--timeout-keep-alive 1``), over raw sockets.

1. Twenty connections that send their request head a byte at a time, reconnecting for several
   seconds: each is closed about the read timeout after it opened (with a 408 when it gets one),
   while normal requests are served meanwhile.
2. Bodies that never complete (a Content-Length never reached), ten at once: each gets a 408 with
   OpenAI's error object and its connection is closed.
3. A connection that sends nothing is closed after the read timeout; one idle after an answer after
   the keep-alive timeout.
4. Bodies sent promptly, large (a few MiB) or in pieces within the deadline, are read and answered.

Also: the flags' bounds. Before the deadlines, a body that never finished was held for as long as
the client liked (15 s observed) and so were dribbling connections (20 s).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from helpers.server import SMALL_ENGINE_ARGS, RemoteServer, assert_serve_flags

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

READ_TIMEOUT_S = 1.5
KEEP_ALIVE_S = 1
# Slack for a busy machine on top of a deadline: every connection here would otherwise stay open
# for as long as its client keeps it (the clients give up after GIVE_UP_S).
SLACK_S = 6.0
GIVE_UP_S = 30.0
DRIBBLERS = 20
DRIBBLE_FOR_S = 6.0
HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    + b"X-Padding: "
    + b"p" * 200
    + b"\r\n\r\n"
)


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    args = [
        *SMALL_ENGINE_ARGS,
        "--request-read-timeout",
        str(READ_TIMEOUT_S),
        "--timeout-keep-alive",
        str(KEEP_ALIVE_S),
    ]
    with RemoteServer(args) as srv:
        yield srv


@dataclass
class Closed:
    """How a raw connection ended: after how long, what the server sent, and how it closed."""

    after: float
    data: bytes
    how: str  # "eof", "reset" or "timeout" (the client gave up)

    @property
    def status(self) -> int | None:
        if not self.data.startswith(b"HTTP/1.1 "):
            return None
        return int(self.data[9:12])

    def error(self) -> dict[str, object]:
        """The OpenAI error object of the response body."""
        body = json.loads(self.data.split(b"\r\n\r\n", 1)[1])
        assert set(body) == {"error"}, body
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        return dict(error)


def _connect(srv: RemoteServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=10)


def _read_until_closed(sock: socket.socket, opened: float) -> Closed:
    """Read what the server sends until it closes the connection (or GIVE_UP_S after ``opened``)."""
    data = b""
    while True:
        sock.settimeout(max(0.01, opened + GIVE_UP_S - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return Closed(time.monotonic() - opened, data, "timeout")
        except ConnectionResetError:
            return Closed(time.monotonic() - opened, data, "reset")
        if not chunk:
            return Closed(time.monotonic() - opened, data, "eof")
        data += chunk


def _dribble(srv: RemoteServer, gap: float = 0.1) -> Closed:
    """Send ``HEAD`` a byte every ``gap`` seconds (25 s for all of it) until the server closes."""
    sock = _connect(srv)
    opened = time.monotonic()
    try:
        for byte in HEAD:
            sock.sendall(bytes([byte]))
            time.sleep(gap)
            if time.monotonic() - opened > GIVE_UP_S:
                break
    except OSError:  # closed by the server
        pass
    try:
        return _read_until_closed(sock, opened)
    finally:
        sock.close()


def _assert_closed_at_deadline(closed: Closed, deadline: float) -> None:
    assert closed.how != "timeout", closed
    assert deadline - 0.1 <= closed.after < deadline + SLACK_S, closed


# ------------------------------------------------------------------------------------------------
# 1. Dribbled request heads
# ------------------------------------------------------------------------------------------------


def test_dribbled_heads_are_closed_while_normal_requests_are_served(server: RemoteServer) -> None:
    completion = {"prompt": "Hi", "max_tokens": 4, "ignore_eos": True}
    started = time.monotonic()
    assert server.post("/v1/completions", json=completion).status_code == 200  # warm-up
    baseline = time.monotonic() - started
    ended: list[Closed] = []
    lock = threading.Lock()
    until = time.monotonic() + DRIBBLE_FOR_S

    def attacker() -> None:
        while time.monotonic() < until:
            closed = _dribble(server)
            with lock:
                ended.append(closed)
            if closed.how == "timeout":
                return

    threads = [threading.Thread(target=attacker, daemon=True) for _ in range(DRIBBLERS)]
    for t in threads:
        t.start()
    served: list[tuple[int, float]] = []
    time.sleep(0.5)
    while time.monotonic() < until:
        started = time.monotonic()
        r = server.post("/v1/completions", json=completion, timeout=60)
        served.append((r.status_code, time.monotonic() - started))
        assert server.get("/health").status_code == 200
    for t in threads:
        t.join(GIVE_UP_S + 10)
        assert not t.is_alive()
    print(
        f"\n{len(ended)} dribbling connections closed after {min(c.after for c in ended):.2f}.."
        f"{max(c.after for c in ended):.2f} s; {len(served)} requests served meanwhile in "
        f"{max(t for _, t in served):.2f} s at most (baseline {baseline:.2f} s)"
    )
    assert len(ended) >= 2 * DRIBBLERS, len(ended)  # each attacker was cut and came back
    for closed in ended:
        _assert_closed_at_deadline(closed, READ_TIMEOUT_S)
        if closed.data:  # a 408 naming the head (unless the close overtook it)
            assert closed.status == 408, closed
            error = closed.error()
            assert error["code"] == "request_timeout" and "request head" in str(error["message"]), error
    assert served and all(status == 200 for status, _ in served), served
    assert max(t for _, t in served) < 10 * baseline + 10, (served, baseline)
    # The server is left with nothing in flight.
    server.wait_idle()


# ------------------------------------------------------------------------------------------------
# 2. Bodies that never complete
# ------------------------------------------------------------------------------------------------


def _partial_body(srv: RemoteServer, out: list[Closed]) -> None:
    sock = _connect(srv)
    opened = time.monotonic()
    head = HEAD.replace(b"\r\n\r\n", b"\r\nContent-Length: 1000\r\n\r\n")
    sock.sendall(head + b'{"prompt": "Hi", ')
    try:
        out.append(_read_until_closed(sock, opened))
    finally:
        sock.close()


def test_bodies_that_never_complete_get_408(server: RemoteServer) -> None:
    ended: list[Closed] = []
    threads = [threading.Thread(target=_partial_body, args=(server, ended), daemon=True) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(GIVE_UP_S + 10)
        assert not t.is_alive()
    assert len(ended) == 10, ended
    for closed in ended:
        _assert_closed_at_deadline(closed, READ_TIMEOUT_S)
        assert closed.how == "eof" and closed.status == 408, closed
        assert b"\r\nconnection: close\r\n" in closed.data.lower(), closed
        error = closed.error()
        assert error["type"] == "invalid_request_error" and error["code"] == "request_timeout", error
        assert error["message"] == (
            f"The request body did not arrive within {READ_TIMEOUT_S:g} s (--request-read-timeout)."
        ), error
    assert server.get("/health").status_code == 200
    server.wait_idle()


# ------------------------------------------------------------------------------------------------
# 3. Silent and idle connections
# ------------------------------------------------------------------------------------------------


def test_silent_connection_is_closed_after_the_read_timeout(server: RemoteServer) -> None:
    sock = _connect(server)
    try:
        closed = _read_until_closed(sock, time.monotonic())
    finally:
        sock.close()
    _assert_closed_at_deadline(closed, READ_TIMEOUT_S)
    assert closed.data == b"", closed  # nothing was asked: nothing is answered


def test_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(server: RemoteServer) -> None:
    sock = _connect(server)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        closed = _read_until_closed(sock, time.monotonic())
    finally:
        sock.close()
    assert closed.status == 200, closed
    _assert_closed_at_deadline(closed, KEEP_ALIVE_S)


# ------------------------------------------------------------------------------------------------
# 4. Bodies that arrive in time
# ------------------------------------------------------------------------------------------------


def test_prompt_bodies_are_read_within_the_deadline(server: RemoteServer) -> None:
    # A large body sent at once: read whole, then refused for its prompt (not for its time).
    large = json.dumps({"prompt": "word " * 700_000, "max_tokens": 1}).encode()
    assert len(large) > 3 << 20
    r = server.post("/v1/completions", content=large, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    # A body in pieces well within the deadline: served.
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    sock = _connect(server)
    opened = time.monotonic()
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        )
        for i in range(0, len(body), 8):
            sock.sendall(body[i : i + 8])
            time.sleep(READ_TIMEOUT_S / 20)
        closed = _read_until_closed(sock, opened)
    finally:
        sock.close()
    assert closed.status == 200, closed
    assert json.loads(closed.data.split(b"\r\n\r\n", 1)[1])["usage"]["completion_tokens"] == 2, closed
    # And a normal client on a kept-alive connection, twice.
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        for _ in range(2):
            assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


# ------------------------------------------------------------------------------------------------
# The flags
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (["--request-read-timeout", "0"], "--request-read-timeout must be positive"),
        (["--request-read-timeout", "nan"], "--request-read-timeout must be positive"),
        (["--timeout-keep-alive", "0"], "--timeout-keep-alive must be at least 1"),
        (["--request-read-timeout", "0.5", "--timeout-keep-alive", "2"], None),
    ],
)
def test_read_timeout_flags(flags: list[str], problem: str | None) -> None:
    assert_serve_flags(flags, problem)
