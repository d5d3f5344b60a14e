"""Streaming for the OpenAI endpoints: server-sent events, merged async iterators and
client-disconnect handling."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from pagedllm.entrypoints.openai.serving_engine import OpenAIError

T = TypeVar("T")


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    """Yield ``(index, item)`` from several async iterators as items become available."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    pending: dict[asyncio.Future[T], int] = {
        asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
                yield i, item
    finally:
        for fut in pending:
            fut.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnected(request: Request, awaitable: Awaitable[T]) -> tuple[bool, T | None]:
    """Run ``awaitable`` unless the client goes away first, in which case it is cancelled.

    Returns ``(completed, result)``. Only for handlers whose request body has been read already.
    """
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return False, None
    return True, task.result()


class SSEResponse(StreamingResponse):
    """A server-sent-events response that runs ``on_close`` however the response ends."""

    def __init__(self, content: AsyncIterator[str], on_close: Any) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse_event(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"

_TEXT_MARKER = "PAGEDLLM_TEXT_MARKER_7f3c1a"


class TextChunkEvents:
    """Server-sent events of one stream's plain text chunks, without building a model per chunk.

    ``make(index, text)`` builds the chunk model of choice ``index`` carrying ``text``; it is
    serialized once per choice with a marker as the text, and every later event of that choice is the
    serialized JSON with the marker's string replaced by ``text``'s (JSON strings encoded as pydantic
    encodes them: no ASCII escaping). Falls back to serializing the model when the marker is not
    found exactly once.
    """

    def __init__(self, make: Callable[[int, str], BaseModel]) -> None:
        self._make = make
        self._parts: dict[int, tuple[str, str] | None] = {}

    def event(self, index: int, text: str) -> str:
        try:
            parts = self._parts[index]
        except KeyError:
            parts = self._parts[index] = self._split(index)
        if parts is None:
            return sse_event(self._make(index, text).model_dump_json())
        before, after = parts
        return f"data: {before}{json.dumps(text, ensure_ascii=False)}{after}\n\n"

    def _split(self, index: int) -> tuple[str, str] | None:
        pieces = self._make(index, _TEXT_MARKER).model_dump_json().split(f'"{_TEXT_MARKER}"')
        return (pieces[0], pieces[1]) if len(pieces) == 2 else None


def sse_error(err: OpenAIError) -> str:
    return sse_event(err.to_body().model_dump_json())
