"""The OpenAI-compatible HTTP server (``pagedllm serve``).

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` (behind ``--api-key`` when one
is set), ``/health``, ``/metrics``, ``/tokenize``, ``/detokenize`` and ``/version``. Every error is
answered with OpenAI's ``{"error": {...}}`` object.

On SIGTERM (or a first Ctrl+C) the server drains: new requests and ``/health`` get 503 while requests
in flight run to completion for up to ``--shutdown-timeout`` seconds; whatever is left is then
aborted and the process exits with status 0. A second Ctrl+C exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.metrics import CONTENT_TYPE, EngineMetrics
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    VersionResponse,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_engine import OpenAIError, error_from_exception, private_tokenizer
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger("pagedllm.entrypoints.openai.api_server")

API_KEY_ENV = "PAGEDLLM_API_KEY"
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
_UNCOUNTED_PATHS = frozenset({"/health", "/metrics"})


def server_version() -> str:
    """The package version (``pagedllm.__version__``, else the installed distribution's)."""
    import pagedllm

    version = getattr(pagedllm, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        from importlib.metadata import version as dist_version

        return dist_version("pagedllm")
    except Exception:  # noqa: BLE001 - not installed: running from a source tree
        return "0.0.0+unknown"


@dataclass
class ServerSettings:
    """Server options that are not engine arguments."""

    served_model_names: list[str]
    api_key: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    shutdown_timeout: float = 30.0
    max_logprobs: int = 20


@dataclass
class ServerState:
    """Mutable server state shared by the middleware, the routes and the shutdown logic."""

    draining: bool = False
    in_flight: int = 0


async def _send_error(err: OpenAIError, scope: Scope, receive: Receive, send: Send) -> None:
    await err.to_response()(scope, receive, send)


class GuardMiddleware:
    """Refuses requests while draining, enforces the body size limit and the API key, and counts
    the requests in flight."""

    def __init__(self, app: ASGIApp, settings: ServerSettings, state: ServerState) -> None:
        self.app = app
        self.settings = settings
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if self.state.draining and path != "/metrics":
            await _send_error(
                OpenAIError(
                    "The server is shutting down.", status_code=503, type="server_error", code="shutting_down"
                ),
                scope,
                receive,
                send,
            )
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        limit = self.settings.max_request_body_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _send_error(_body_too_large(limit), scope, receive, send)
            return
        key = self.settings.api_key
        if key and (path == "/v1" or path.startswith("/v1/")):
            given = headers.get("authorization", "")
            expected = f"Bearer {key}"
            if not secrets.compare_digest(given.encode(), expected.encode()):
                await _send_error(
                    OpenAIError(
                        "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                        status_code=401,
                        param=None,
                        code="invalid_api_key",
                    ),
                    scope,
                    receive,
                    send,
                )
                return

        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
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


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = list(exc.errors())
    first = errors[0] if errors else {}
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "invalid JSON")
        return OpenAIError(f"The request body is not valid JSON: {detail}.", param=None)
    param = str(loc[1]) if len(loc) > 1 and loc[0] == "body" else None
    parts = []
    for e in errors[:3]:
        where = ".".join(str(x) for x in tuple(e.get("loc", ()))[1:]) or "body"
        parts.append(f"{where}: {e.get('msg', 'invalid value')}")
    if len(errors) > 3:
        parts.append(f"and {len(errors) - 3} more errors")
    return OpenAIError("Invalid request: " + "; ".join(parts), param=param)


@dataclass
class Serving:
    """What the routes serve, kept on ``app.state.serving``.

    The route handlers are module-level functions that look this up on the request's app: FastAPI
    caches facts about endpoint functions in process-wide caches, so handlers that closed over an
    engine would keep it (weights and KV cache) alive after its app is gone."""

    engine: AsyncLLMEngine
    state: ServerState
    metrics: EngineMetrics | None
    served_model_names: list[str]
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    tokenization: OpenAIServingTokenization


def _serving(request: Request) -> Serving:
    serving: Serving = request.app.state.serving
    return serving


router = APIRouter()


@router.post("/v1/completions")
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    return await _serving(raw_request).completion.create_completion(request, raw_request)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    return await _serving(raw_request).chat.create_chat_completion(request, raw_request)


@router.get("/v1/models")
async def list_models(raw_request: Request) -> Response:
    serving = _serving(raw_request)
    root = str(serving.engine.engine.model_name)
    max_model_len = serving.completion.max_model_len
    cards = [
        ModelCard(id=name, root=root, max_model_len=max_model_len) for name in serving.served_model_names
    ]
    return JSONResponse(ModelList(data=cards).model_dump())


@router.get("/health")
async def health(raw_request: Request) -> Response:
    serving = _serving(raw_request)
    if serving.state.draining:
        return OpenAIError(
            "The server is shutting down.", status_code=503, type="server_error", code="shutting_down"
        ).to_response()
    if not serving.engine.is_running:
        return _dead(serving.engine).to_response()
    return Response(status_code=200)


@router.get("/metrics")
async def prometheus_metrics(raw_request: Request) -> Response:
    metrics = _serving(raw_request).metrics
    body = metrics.render() if metrics is not None else b""
    return Response(body, media_type=CONTENT_TYPE)


@router.get("/version")
async def version() -> Response:
    return JSONResponse(VersionResponse(version=server_version()).model_dump())


@router.post("/tokenize")
async def tokenize(request: TokenizeRequest, raw_request: Request) -> Response:
    return JSONResponse(_serving(raw_request).tokenization.tokenize(request).model_dump())


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> Response:
    return JSONResponse(_serving(raw_request).tokenization.detokenize(request).model_dump())


async def _openai_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIError)
    return exc.to_response()


async def _request_validation_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return _validation_error(exc).to_response()


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return OpenAIError(str(exc.detail), status_code=exc.status_code, type=kind, code=code).to_response()


async def _internal_error(_: Request, exc: Exception) -> Response:
    return error_from_exception(exc).to_response()


def build_app(
    engine: AsyncLLMEngine,
    settings: ServerSettings,
    metrics: EngineMetrics | None = None,
    state: ServerState | None = None,
) -> FastAPI:
    """Build the FastAPI app serving ``engine``; the engine thread starts and stops with the app."""
    state = state or ServerState()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="pagedllm OpenAI-compatible server", version=server_version(), lifespan=lifespan)
    names = settings.served_model_names
    shared: dict[str, Any] = {
        "max_logprobs": settings.max_logprobs,
        "tokenizer": private_tokenizer(engine.engine.tokenizer),
    }
    app.state.serving = Serving(
        engine=engine,
        state=state,
        metrics=metrics,
        served_model_names=list(names),
        completion=OpenAIServingCompletion(engine, names, **shared),
        chat=OpenAIServingChat(engine, names, **shared),
        tokenization=OpenAIServingTokenization(engine, names, **shared),
    )
    app.add_middleware(GuardMiddleware, settings=settings, state=state)
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _request_validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.include_router(router)
    return app


def _dead(engine: AsyncLLMEngine) -> OpenAIError:
    reason = engine.dead_error
    message = "The engine is not running." if reason is None else f"The engine has stopped: {reason}"
    return OpenAIError(message, status_code=503, type="server_error", code="engine_dead")


class GracefulServer(uvicorn.Server):
    """A uvicorn server that drains in-flight requests on SIGTERM/SIGINT before it exits."""

    def __init__(
        self, config: uvicorn.Config, state: ServerState, engine: AsyncLLMEngine, shutdown_timeout: float
    ) -> None:
        super().__init__(config)
        self.state = state
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Unlike uvicorn's version, signals are not re-raised after the shutdown: a drained shutdown
        # is a clean exit.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None:  # not serving yet
            self.should_exit = True
            return
        if self.state.draining:
            if sig == signal.SIGINT:
                logger.warning("Interrupted again: exiting now.")
                self.should_exit = True
                self.force_exit = True
            return
        self.state.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()

        def busy() -> bool:
            return self.state.in_flight > 0 or self.engine.num_active_requests > 0

        logger.info(
            "Shutting down: refusing new requests, waiting up to %.1f s for %d in-flight request(s).",
            self.shutdown_timeout,
            self.state.in_flight,
        )
        deadline = loop.time() + self.shutdown_timeout
        while busy() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if busy():
            aborted = self.engine.abort_all("The server is shutting down.")
            logger.warning("Shutdown timeout reached: aborted %d request(s).", aborted)
            grace = loop.time() + 5.0
            while self.state.in_flight > 0 and loop.time() < grace:
                await asyncio.sleep(0.05)
        self.should_exit = True


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``pagedllm serve``: the server's own and every engine argument."""
    parser.add_argument(
        "model", nargs="?", default=None, help="Model path or name (default: the default model)."
    )
    parser.add_argument("--host", default="127.0.0.1", help="Address to bind (default 127.0.0.1).")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on (default 8000).")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"Require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV} if set).",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="Refuse new requests with 503 while this many are waiting to be scheduled (default: no limit).",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="Seconds to let in-flight requests finish after SIGTERM before aborting them (default 30).",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="Refuse larger request bodies with 413 (default 16 MiB).",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="Log level of the server and the engine (default info).",
    )
    EngineConfig.add_cli_args(parser, with_model=False)


def _check_args(args: argparse.Namespace) -> str | None:
    if not 0 <= args.port <= 65535:
        return f"--port must be in [0, 65535], got {args.port}."
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        return f"--max-queued-requests must be non-negative, got {args.max_queued_requests}."
    if args.shutdown_timeout < 0:
        return f"--shutdown-timeout must be non-negative, got {args.shutdown_timeout}."
    if args.max_request_body_bytes < 1:
        return f"--max-request-body-bytes must be positive, got {args.max_request_body_bytes}."
    return None


def run(args: argparse.Namespace) -> int:
    """Load the model, serve until SIGTERM/SIGINT, and return the exit status."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s", force=True
    )
    problem = _check_args(args)
    if problem is not None:
        logger.error(problem)
        return 2
    try:
        config = EngineConfig.from_cli_args(args, model=args.model)
    except ValueError as exc:
        logger.error("Invalid engine arguments: %s", exc)
        return 2

    from pagedllm.engine.llm_engine import LLMEngine

    try:
        llm_engine = LLMEngine.from_config(config)
    except (ValueError, OSError) as exc:
        logger.error("Could not start the engine: %s", exc)
        return 1
    served_name = config.served_model_name or str(llm_engine.model_name)
    metrics = EngineMetrics(served_name)
    engine = AsyncLLMEngine(llm_engine, max_queued_requests=args.max_queued_requests, metrics=metrics)
    settings = ServerSettings(
        served_model_names=[served_name],
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_request_body_bytes=args.max_request_body_bytes,
        shutdown_timeout=args.shutdown_timeout,
        max_logprobs=config.max_logprobs,
    )
    state = ServerState()
    app = build_app(engine, settings, metrics, state)
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
    )
    server = GracefulServer(uv_config, state, engine, args.shutdown_timeout)
    logger.info(
        "Serving %s (max_model_len %d) on http://%s:%d",
        served_name,
        llm_engine.max_model_len,
        args.host,
        args.port,
    )
    server.run()
    engine.shutdown()
    logger.info("Server stopped.")
    return 0
