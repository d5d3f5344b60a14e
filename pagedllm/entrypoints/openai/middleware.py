"""The HTTP layer around the routes: draining, the body-size limit, the body's read deadline and
the API key (one ASGI middleware), OpenAI error objects for every error, and an OpenAPI document
that says so."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.entrypoints.openai.cli_args import ServerSettings
from pagedllm.entrypoints.openai.dashboard_auth import (
    LOGIN_PATH,
    PAGE_PATH,
    bearer_key,
    dashboard_key,
    login_page,
)
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.http_timeouts import request_timeout
from pagedllm.entrypoints.openai.protocol import ErrorResponse
from pagedllm.entrypoints.openai.serving_engine import error_from_exception

_UNCOUNTED_PATHS = frozenset({"/health", "/metrics"})


@dataclass
class ServerState:
    """Mutable server state shared by the middleware, the routes and the shutdown logic."""

    draining: bool = False
    in_flight: int = 0


def shutting_down() -> OpenAIError:
    return OpenAIError(
        "The server is shutting down.", status_code=503, type="server_error", code="shutting_down"
    )


class GuardMiddleware:
    """Refuses requests while draining, enforces the body size limit, the body's read deadline (the
    whole body within ``request_read_timeout`` seconds, else 408 and the connection closed) and the
    API key (on every path but ``/health``, and ``/metrics`` with ``metrics_without_auth``), and
    counts the requests in flight.
    On the dashboard's routes the key may also come as the dashboard's cookie (see
    :mod:`~pagedllm.entrypoints.openai.dashboard_auth`); the page answers a browser without it with
    a login form (status 401)."""

    def __init__(self, app: ASGIApp, settings: ServerSettings, state: ServerState) -> None:
        self.app = app
        self.settings = settings
        self.state = state
        self.open_paths = frozenset(
            {
                "/health",
                *(["/metrics"] if settings.metrics_without_auth else []),
                *([] if settings.disable_dashboard else [LOGIN_PATH]),  # the form checks the key itself
            }
        )
        self.dashboard = not settings.disable_dashboard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if self.state.draining and path != "/metrics":
            await shutting_down().to_response()(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        limit = self.settings.max_request_body_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _body_too_large(limit).to_response()(scope, receive, send)
            return
        keys = self.settings.api_keys
        if keys and path not in self.open_paths:
            key = bearer_key(headers.get("authorization", ""), keys)
            if key is None and self.dashboard:
                key = dashboard_key(path, headers.get("cookie"), scope.get("query_string", b""), keys)
            if key is None:
                if self.dashboard and path == PAGE_PATH and scope.get("method") == "GET":
                    page = HTMLResponse(login_page(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                    await page(scope, receive, send)
                    return
                error = OpenAIError(
                    "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                    status_code=401,
                    param=None,
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error.to_response()(scope, receive, send)
                return
            # The key the request came with (``request.state.api_key``): stored responses are its own.
            scope.setdefault("state", {})["api_key"] = key

        received = 0
        # The whole body must be in within the read timeout of the head (the request's start here).
        loop = asyncio.get_running_loop()
        read_timeout = self.settings.request_read_timeout
        deadline: float | None = loop.time() + read_timeout

        async def limited_receive() -> Message:
            nonlocal received, deadline
            if deadline is None:  # the body is in: wait for a disconnection as long as it takes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                timeout = request_timeout("request body", read_timeout)
                raise StarletteHTTPException(408, detail=timeout.message, headers=timeout.headers) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                deadline = None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise StarletteHTTPException(status_code=413, detail=_body_too_large(limit).message)
            return message

        counted = path not in _UNCOUNTED_PATHS
        if counted:
            self.state.in_flight += 1
        try:
            await self.app(scope, limited_receive, send)
        finally:
            if counted:
                self.state.in_flight -= 1


def _body_too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        f"The request body exceeds the limit of {limit} bytes.", status_code=413, code="request_too_large"
    )


def validation_error(exc: RequestValidationError, content_type: str | None = None) -> OpenAIError:
    """A 400 naming the first invalid top-level field of the body (``content_type``: the request's,
    named when a body that is not declared JSON was not read)."""
    errors = list(exc.errors())
    first = errors[0] if errors else {}
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "invalid JSON")
        return OpenAIError(f"The request body is not valid JSON: {detail}.", param=None)
    if loc == ("body",) and not _is_json(content_type):
        return OpenAIError(
            "The request body must be a JSON object sent with 'Content-Type: application/json', got "
            f"Content-Type {(content_type or 'none')[:100]!r}.",
            param=None,
        )
    param = str(loc[1]) if len(loc) > 1 and loc[0] == "body" else None
    parts = []
    for e in errors[:3]:
        where = ".".join(str(x) for x in tuple(e.get("loc", ()))[1:]) or "body"
        parts.append(f"{where}: {e.get('msg', 'invalid value')}")
    if len(errors) > 3:
        parts.append(f"and {len(errors) - 3} more errors")
    return OpenAIError("Invalid request: " + "; ".join(parts), param=param)


async def _openai_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIError)
    return exc.to_response()


def _is_json(content_type: str | None) -> bool:
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )


async def _request_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return validation_error(exc, request.headers.get("content-type")).to_response()


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    code = {
        404: "not_found",
        405: "method_not_allowed",
        408: "request_timeout",
        413: "request_too_large",
    }.get(exc.status_code)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    # Starlette's headers (the Allow header of a 405) are kept.
    return OpenAIError(
        str(exc.detail), status_code=exc.status_code, type=kind, code=code, headers=exc.headers
    ).to_response()


async def _internal_error(_: Request, exc: Exception) -> Response:
    return error_from_exception(exc).to_response()


def install_error_handlers(app: FastAPI) -> None:
    """Every error, including FastAPI's validation errors (400, not 422), as an OpenAI error object."""
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _request_validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.openapi = _openapi_with_openai_errors(app.openapi)  # type: ignore[method-assign]


_ERROR_REF = "#/components/schemas/ErrorResponse"

# What the guard answers on any route, for the OpenAPI document (see GuardMiddleware).
_GUARD_ERRORS = {
    "401": "A missing or wrong API key (with --api-key: every route but /health, and /metrics unless "
    "--metrics-without-auth).",
    "408": "The request body did not arrive within --request-read-timeout (code request_timeout).",
    "413": "The request body is larger than --max-request-body-bytes.",
    "503": "The server is shutting down (code shutting_down).",
}
# The errors of the routes, besides the guard's, for their OpenAPI document.
MODEL_ERRORS = {404: "The model does not exist (code model_not_found)."}
GENERATION_ERRORS = {
    **MODEL_ERRORS,
    500: "The engine failed while serving the request (code engine_dead), or an internal error.",
    503: "The queue of waiting sequences is full (queue_full), the engine has stopped (engine_dead) or "
    "the server is shutting down (shutting_down).",
}
HEALTH_ERRORS = {
    503: "The engine has stopped (engine_dead), a core has missed its heartbeats for 2 s "
    "(engine_unresponsive) or the server is shutting down (shutting_down)."
}


def route_responses(
    ok: type[BaseModel] | None = None, errors: Mapping[int, str] | None = None, *, stream: bool = False
) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` argument of a route, for the OpenAPI document: its 200 body (``ok``; with
    ``stream``, server-sent events too) and its errors, each an OpenAI error object."""
    responses: dict[int | str, dict[str, Any]] = {}
    if ok is not None:
        responses[200] = {"model": ok, "description": "Successful response."}
        if stream:
            responses[200]["description"] = (
                "The response; with stream true, server-sent events of its chunks."
            )
            # Each event: a ``data`` line holding one JSON chunk (or ``[DONE]``).
            event = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
            responses[200]["content"] = {"text/event-stream": {"schema": event}}
    for status, description in (errors or {}).items():
        responses[status] = {"model": ErrorResponse, "description": description}
    return responses


def _openapi_with_openai_errors(generate: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """FastAPI documents its validation errors as 422 with its own schema; this server answers them
    with 400 and an OpenAI error object, so the document says that instead."""

    def openapi() -> dict[str, Any]:
        schema = generate()
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        if "ErrorResponse" not in schemas:
            error = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(error.pop("$defs", {}))
            schemas["ErrorResponse"] = error
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.get("responses", {})
                if responses.pop("422", None) is not None:
                    responses["400"] = {
                        "description": "Invalid request: an OpenAI error object naming the field.",
                        "content": {"application/json": {"schema": {"$ref": _ERROR_REF}}},
                    }
        for path, operations in schema.get("paths", {}).items():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                for status, description in _GUARD_ERRORS.items():
                    if (
                        (status == "401" and path == "/health")
                        or (status in ("408", "413") and "requestBody" not in operation)
                        or (status == "503" and path == "/metrics")
                    ):
                        continue
                    responses.setdefault(
                        status,
                        {
                            "description": description,
                            "content": {"application/json": {"schema": {"$ref": _ERROR_REF}}},
                        },
                    )
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        return schema

    return openapi
