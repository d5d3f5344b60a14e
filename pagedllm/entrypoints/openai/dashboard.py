"""The live dashboard: the page (``/dashboard`` and its files), the engine's snapshot
(``/v1/engine/state``) and the stream of its steps (``/v1/engine/events``, server-sent events).

All of it sits behind ``--api-key`` (the guard also takes the dashboard's cookie here, see
:mod:`~pagedllm.entrypoints.openai.dashboard_auth`) and is absent with ``--disable-dashboard``.
Nothing here runs unless a client asks: the engine fills its bounded step ring anyway, and each open
event stream reads that ring every ``EVENT_POLL_S`` seconds on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from pagedllm.entrypoints.openai.dashboard_auth import (
    LOGIN_PATH,
    PAGE_PATH,
    login_page,
    matching_key,
    set_cookie_headers,
)
from pagedllm.entrypoints.openai.errors import OpenAIError

STATIC_DIR = Path(__file__).resolve().parent / "dashboard_static"
# The files the page loads, and their media types (nothing else under STATIC_DIR is served).
STATIC_FILES = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
DEFAULT_STEPS = 64  # step records in a snapshot unless ?steps= says otherwise
MAX_STEPS = 1024  # at most this many per answer
EVENT_POLL_S = 0.1  # how often an event stream looks for new steps
EVENT_PING_S = 10.0  # a comment line this often keeps idle connections open through proxies
_NO_STORE = {"Cache-Control": "no-store"}

router = APIRouter(include_in_schema=False)
_encoder = msgspec.json.Encoder()


def _engine(request: Request) -> Any:
    return request.app.state.serving.engine


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise OpenAIError(f"{name} must be an integer, got {raw[:40]!r}.", param=name) from None
    if not low <= value <= high:
        raise OpenAIError(f"{name} must be in [{low}, {high}], got {value}.", param=name)
    return value


def _rank(request: Request, engine: Any) -> int:
    ranks: list[int] = engine.engine_ranks
    rank = _int_param(request, "rank", ranks[0] if ranks else 0, 0, 2**16)
    if rank not in ranks:
        raise OpenAIError(f"rank {rank}: no engine of that rank is running (ranks: {ranks}).", param="rank")
    return rank


@router.get(PAGE_PATH)
async def dashboard_page(request: Request) -> Response:
    """The page; with ``?key=`` (already checked by the guard) the key becomes the cookie."""
    key = getattr(request.state, "api_key", None)  # the one the guard accepted
    if key and "key" in request.query_params:
        return _to_page(key)  # the key leaves the address bar and the history
    return Response(
        (STATIC_DIR / "index.html").read_bytes(), media_type="text/html; charset=utf-8", headers=_NO_STORE
    )


@router.post(LOGIN_PATH)
async def dashboard_login(request: Request) -> Response:
    """The login form's target: a right key sets the cookie and goes to the page."""
    keys = request.app.state.serving_settings.api_keys
    body = (await request.body())[:4096].decode("utf-8", "replace")
    given = (parse_qs(body).get("key") or [""])[0]
    if not keys:
        return Response(status_code=303, headers={"Location": PAGE_PATH})
    key = matching_key(given, keys)
    if key is None:
        return Response(
            login_page("That is not this server's API key."), status_code=401, media_type="text/html"
        )
    return _to_page(key)


def _to_page(key: str) -> Response:
    """A redirect to the page that sets the dashboard's cookies."""
    response = Response(status_code=303, headers={"Location": PAGE_PATH, **_NO_STORE})
    for name, value in set_cookie_headers(key):
        response.headers.append(name, value)
    return response


@router.get(PAGE_PATH + "/static/{name}")
async def dashboard_static(name: str) -> Response:
    media_type = STATIC_FILES.get(name)
    if media_type is None:
        raise OpenAIError(f"No dashboard file {name[:60]!r}.", status_code=404, code="not_found")
    return Response((STATIC_DIR / name).read_bytes(), media_type=media_type, headers=_NO_STORE)


@router.get("/v1/engine/state")
async def engine_state(request: Request) -> Response:
    """The engine's snapshot (KV block map, requests, counters) and its latest steps, as JSON."""
    engine = _engine(request)
    rank = _rank(request, engine)
    since = _int_param(request, "since", 0, 0, 2**62)
    limit = _int_param(request, "steps", DEFAULT_STEPS, 0, MAX_STEPS)
    try:
        state = await engine.engine_state(rank)
    except TimeoutError:
        raise OpenAIError(
            "The engine did not answer in time (a long step?); retry.", status_code=503, code="engine_busy"
        ) from None
    except RuntimeError as exc:
        raise OpenAIError(str(exc), status_code=501, code="not_implemented") from None
    steps = engine.step_records(since, limit, rank) if limit else []
    # The snapshot is a JSON object: splice the steps and the rank in front of its fields.
    head = b'{"rank":%d,"ranks":%s,"steps":%s,' % (
        rank,
        _encoder.encode(engine.engine_ranks),
        _encoder.encode(steps),
    )
    return Response(head + state[1:], media_type="application/json", headers=_NO_STORE)


@router.get("/v1/engine/events")
async def engine_events(request: Request) -> Response:
    """Server-sent events: ``event: steps`` with a JSON array of new step records, as they come
    (``?since=N``: from step N + 1; default: the latest 64)."""
    engine = _engine(request)
    rank = _rank(request, engine)
    since = _int_param(request, "since", -1, -1, 2**62)
    state = request.app.state.serving.state

    async def stream() -> AsyncIterator[bytes]:
        last = since
        if last < 0:
            latest = engine.step_records(0, 1, rank)
            last = max(0, latest[-1].step - DEFAULT_STEPS) if latest else 0
        idle = 0.0
        yield b"retry: 2000\n\n"
        while not state.draining and engine.is_running:
            records = engine.step_records(last, MAX_STEPS, rank)
            if records:
                last = records[-1].step
                yield b"event: steps\nid: %d\ndata: %s\n\n" % (last, _encoder.encode(records))
                idle = 0.0
            elif idle >= EVENT_PING_S:
                yield b": ping\n\n"
                idle = 0.0
            await asyncio.sleep(EVENT_POLL_S)
            idle += EVENT_POLL_S

    headers = {**_NO_STORE, "X-Accel-Buffering": "no"}
    return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)
