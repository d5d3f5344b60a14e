"""A streamed request to a real server, read on a thread: what came back and when it ended.

Used by the process tests (killed, stopped and drained cores and servers), which need to watch a
stream while they act on the processes behind it.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from helpers.server import RemoteServer


def completion_body(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A greedy streamed completion of exactly ``max_tokens`` tokens, with its usage chunk."""
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


@dataclass
class SSEStream:
    """``body`` posted to ``path`` with ``stream: true``, read on a thread.

    ``chunks`` counts the data events other than errors (usage included); ``error`` is an error event
    (or a refused request's error object); ``last`` the last data line; ``ended`` when the reading
    stopped (``time.monotonic``). ``first`` is set at the first chunk or at the end."""

    srv: RemoteServer
    body: dict[str, Any]
    path: str = "/v1/completions"
    hold: threading.Event | None = None  # after the first chunk, wait for this before reading on
    stop: threading.Event = field(default_factory=threading.Event)  # set: close the connection
    status: int = 0
    chunks: int = 0
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    last: str = ""
    exception: str = ""
    ended: float = 0.0
    first: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> SSEStream:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            with httpx.stream("POST", self.srv.url(self.path), json=self.body, timeout=120) as r:
                self.status = r.status_code
                if r.status_code != 200:
                    r.read()
                    self.error = r.json().get("error")
                    return
                for line in r.iter_lines():
                    if self.stop.is_set():
                        return
                    if not line.startswith("data: "):
                        continue
                    self.last = line
                    if line == "data: [DONE]":
                        break
                    payload = json.loads(line[6:])
                    if "error" in payload:
                        self.error = payload["error"]
                        continue
                    self._add(payload)
                    if not self.first.is_set():
                        self.first.set()
                        if self.hold is not None:
                            self.hold.wait(60)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.exception = repr(exc)
        finally:
            self.ended = time.monotonic()
            self.first.set()

    def _add(self, chunk: dict[str, Any]) -> None:
        self.chunks += 1
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            self.text += choice.get("text") or delta.get("content") or ""
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if chunk.get("usage"):
            self.usage = chunk["usage"]

    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def join(self, timeout: float = 300.0) -> SSEStream:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"stream still running after {timeout:g} s: {self}"
        return self

    def wait_first(self, timeout: float = 120.0) -> None:
        assert self.first.wait(timeout) and self.chunks > 0, self

    def assert_completed(self, max_tokens: int) -> None:
        assert not self.exception and self.error is None and self.status == 200, self
        assert self.finish_reason == "length" and self.last == "data: [DONE]", self
        assert self.usage is not None and self.usage["completion_tokens"] == max_tokens, self

    def assert_failed_with_error_event(self) -> dict[str, Any]:
        """The stream was accepted, then ended with an error event and ``[DONE]``."""
        assert not self.exception and self.status == 200, self
        assert self.error is not None and self.last == "data: [DONE]", self
        return self.error
