"""Deadlines for reading requests, so that a slow or stalled client cannot hold a connection.

uvicorn bounds only the idle time between two requests of a kept-alive connection
(``--timeout-keep-alive``): a client that opens a connection and sends nothing, or sends its request
head or body a byte at a time, holds the connection for as long as it likes. The server therefore
serves HTTP/1.1 with :class:`TimedH11Protocol`, uvicorn's h11 protocol with one timer per connection,
armed whenever the server waits on the client for part of a request:

* the **head** (request line and headers) must arrive within ``read_timeout`` seconds of the
  connection's opening, or of the first byte of the head on a kept-alive connection; otherwise the
  connection is closed, after a 408 with OpenAI's error object when part of a head had come;
* the **body** must arrive within ``read_timeout`` seconds of the head. The app's reading of it is
  bounded by :class:`~pagedllm.entrypoints.openai.middleware.GuardMiddleware`, which answers 408
  (OpenAI's error object, ``Connection: close``); this protocol closes the connection
  :data:`BODY_CLOSE_GRACE_S` later if the body is still incomplete (a route that answered without
  reading the body, a client that dribbles on after its answer).

Between requests the keep-alive timer closes an idle connection; while a request is being served
(its head and body read) no timer runs, so a long generation is never cut. The protocol is used
whatever HTTP implementation uvicorn would pick by itself, so the deadlines always hold.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedllm.entrypoints.openai.cli_args import DEFAULT_REQUEST_READ_TIMEOUT_S
from pagedllm.entrypoints.openai.errors import OpenAIError

logger = logging.getLogger("pagedllm.entrypoints.openai.http_timeouts")

# The protocol closes a connection whose body is incomplete this long after the body's deadline (the
# app's 408 goes out first).
BODY_CLOSE_GRACE_S = 1.0


def request_timeout(what: str, timeout: float) -> OpenAIError:
    """The 408 answered when ``what`` ("request head", "request body") is not in after ``timeout``."""
    return OpenAIError(
        f"The {what} did not arrive within {timeout:g} s (--request-read-timeout).",
        status_code=408,
        code="request_timeout",
        headers={"Connection": "close"},
    )


def _raw_408(timeout: float) -> bytes:
    """A complete 408 response, written before h11 has seen a request (it cannot send one then)."""
    body = request_timeout("request head", timeout).to_body().model_dump_json().encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the read deadlines of this module (``read_timeout`` seconds; set
    by :func:`timed_h11_protocol`).

    Invariant: while the connection is open and no request is being served, a timer runs: this
    protocol's (a head or a body awaited) or uvicorn's keep-alive timer (idle between requests)."""

    read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._awaiting: str | None = None  # "head" or "body" while the timer runs

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm("head")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def _follow(self) -> None:
        """Arm the timer for what the connection now awaits from the client, if anything."""
        if self.transport.is_closing():
            self._disarm()
            return
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._arm("body")
        elif state is h11.IDLE and (self.conn.trailing_data[0] or self.timeout_keep_alive_task is None):
            self._arm("head")  # a head under way (or no keep-alive timer to close an idle connection)
        else:
            self._disarm()  # a request being served, or idle under the keep-alive timer

    def _arm(self, awaiting: str) -> None:
        if self._awaiting == awaiting and self._timer is not None:
            return  # the deadline runs from when this part began to be awaited
        self._disarm()
        delay = self.read_timeout + (BODY_CLOSE_GRACE_S if awaiting == "body" else 0.0)
        self._awaiting = awaiting
        self._timer = self.loop.call_later(delay, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._awaiting = None

    def _expired(self) -> None:
        awaiting, self._timer, self._awaiting = self._awaiting, None, None
        if self.transport.is_closing():
            return
        started = awaiting == "head" and bool(self.conn.trailing_data[0])
        if started and self.conn.our_state is h11.IDLE:
            self.transport.write(_raw_408(self.read_timeout))
        if awaiting == "body" or started:
            logger.info(
                "Closing a connection from %s: its request %s did not arrive within %g s.",
                f"{self.client[0]}:{self.client[1]}" if self.client else "?",
                awaiting,
                self.read_timeout,
            )
        self.transport.close()


def timed_h11_protocol(read_timeout: float) -> type[TimedH11Protocol]:
    """The protocol class to give uvicorn (``uvicorn.Config(http=...)``) for ``read_timeout``."""

    class Protocol(TimedH11Protocol):
        pass

    Protocol.read_timeout = read_timeout
    return Protocol


__all__ = [
    "BODY_CLOSE_GRACE_S",
    "TimedH11Protocol",
    "request_timeout",
    "timed_h11_protocol",
]
