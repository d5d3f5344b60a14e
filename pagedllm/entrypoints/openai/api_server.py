"""The OpenAI-compatible HTTP app and its server loop (``pagedllm serve``; the processes around it
are :mod:`pagedllm.entrypoints.openai.launcher`'s).

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings``, ``/v1/models``, ``/health``,
``/metrics``, ``/tokenize``, ``/detokenize``, ``/version``, ``/v1/responses`` (a view over chat
completions), the API documents (``/docs``, ``/redoc``, ``/openapi.json``; off with
``--disable-fastapi-docs``) and the live dashboard (``/dashboard``, ``/v1/engine/state``,
``/v1/engine/events``; off with ``--disable-dashboard``). With ``--api-key`` every route but ``/health``
needs the key (``/metrics`` too unless ``--metrics-without-auth``). Every error is answered with
OpenAI's ``{"error": {...}}`` object. Requests are tokenized and chat templates rendered on worker
threads (:mod:`pagedllm.entrypoints.openai.preprocess`), within the limits of
:mod:`pagedllm.entrypoints.openai.limits`.

On SIGTERM (or a first Ctrl+C) the server drains: new requests and ``/health`` get 503 while requests
in flight run to completion for up to ``--shutdown-timeout`` seconds; whatever is left is then
aborted and the process exits with status 0. A second Ctrl+C exits at once.

If the engine dies (an exception in a step, a core process that exits, or a core silent for
``--engine-liveness-timeout`` seconds), every request in flight gets an error at once, new requests
and ``/health`` get 503 naming the cause, and a second later the process exits with status 1, so
that a supervisor restarts it. A core that has only missed its heartbeats for 2 s (stopped, hung,
or starved of CPU; half the liveness timeout if that is shorter) already makes ``/health`` say 503
(code ``engine_unresponsive``), until it is heard from again or taken for dead.

Slow clients: a request's head must arrive within ``--request-read-timeout`` seconds (of the
connection's opening, or of its first byte on a kept-alive connection) and its body within as long
again, else the connection is answered 408 and closed (see :mod:`.http_timeouts`); an idle kept-alive
connection is closed after ``--timeout-keep-alive`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from pagedllm.engine.async_client import AsyncEngineClient
from pagedllm.engine.observe.metrics import CONTENT_TYPE, EngineMetrics
from pagedllm.engine.proc.async_mp_engine import AsyncMPEngine
from pagedllm.entrypoints.openai.cli_args import (
    API_KEY_ENV,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    ServerSettings,
    add_cli_args,
    settings_from_args,
)
from pagedllm.entrypoints.openai.dashboard import router as dashboard_router
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.http_timeouts import timed_h11_protocol
from pagedllm.entrypoints.openai.lora_routes import router as lora_router
from pagedllm.entrypoints.openai.middleware import (
    GENERATION_ERRORS,
    HEALTH_ERRORS,
    MODEL_ERRORS,
    GuardMiddleware,
    ServerState,
    install_error_handlers,
    route_responses,
    shutting_down,
)
from pagedllm.entrypoints.openai.preprocess import Preprocessor, private_tokenizer
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from pagedllm.entrypoints.openai.protocol_embedding import EmbeddingRequest, EmbeddingResponse
from pagedllm.entrypoints.openai.protocol_responses import (
    InputItemList,
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
)
from pagedllm.entrypoints.openai.response_store import ResponseStore
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_embedding import (
    OpenAIServingEmbedding,
    engine_task,
    wrong_task_error,
)
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.model.tokenizer import template_handles_tools, tools_template

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_MAX_REQUEST_BODY_BYTES",
    "ServerSettings",
    "ServerState",
    "add_cli_args",
    "build_app",
    "serve_engine",
]

logger = logging.getLogger("pagedllm.entrypoints.openai.api_server")


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
class Serving:
    """What the routes serve, kept on ``app.state.serving``.

    The route handlers are module-level functions that look this up on the request's app: FastAPI
    caches facts about endpoint functions in process-wide caches, so handlers that closed over an
    engine would keep it (weights and KV cache) alive after its app is gone."""

    engine: AsyncEngineClient
    state: ServerState
    metrics: EngineMetrics | None
    served_model_names: list[str]
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    tokenization: OpenAIServingTokenization
    embedding: OpenAIServingEmbedding
    # Where responses are kept (shared by the server's front-ends).
    response_store: ResponseStore
    # A view over ``chat``: each Responses request is answered by the chat handler.
    responses: OpenAIServingResponses = field(init=False)

    def __post_init__(self) -> None:
        self.responses = OpenAIServingResponses(self.chat, self.response_store)


def _serving(request: Request) -> Serving:
    serving: Serving = request.app.state.serving
    return serving


def _generating(request: Request, endpoint: str) -> Serving:
    """The app's :class:`Serving`, after checking that its engine generates (an embed server does not)."""
    serving = _serving(request)
    task = engine_task(serving.engine)
    if task != "generate":
        raise wrong_task_error(task, endpoint)
    return serving


router = APIRouter()


@router.post("/v1/completions", responses=route_responses(CompletionResponse, GENERATION_ERRORS, stream=True))
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    serving = _generating(raw_request, "/v1/completions")
    return await serving.completion.create_completion(request, raw_request)


@router.post(
    "/v1/chat/completions", responses=route_responses(ChatCompletionResponse, GENERATION_ERRORS, stream=True)
)
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    serving = _generating(raw_request, "/v1/chat/completions")
    return await serving.chat.create_chat_completion(request, raw_request)


@router.post("/v1/embeddings", responses=route_responses(EmbeddingResponse, GENERATION_ERRORS))
async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
    return await _serving(raw_request).embedding.create_embedding(request, raw_request)


@router.get("/v1/models", responses=route_responses(ModelList))
async def list_models(raw_request: Request) -> Response:
    serving = _serving(raw_request)
    info = serving.engine.info
    root = info.model_name
    max_model_len = serving.completion.max_model_len
    generation_config = dict(info.default_sampling)
    cards = [
        ModelCard(id=name, root=root, max_model_len=max_model_len, generation_config=generation_config)
        for name in serving.served_model_names
    ]
    base = serving.served_model_names[0]
    cards += [
        ModelCard(
            id=name, root=lora.lora_path, parent=lora.base_model_name or base, max_model_len=max_model_len
        )
        for name, lora in serving.completion.lora_modules.items()
    ]
    return JSONResponse(ModelList(data=cards).model_dump())


@router.get("/health", response_class=Response, responses=route_responses(None, HEALTH_ERRORS))
async def health(raw_request: Request) -> Response:
    serving = _serving(raw_request)
    if serving.state.draining:
        return shutting_down().to_response()
    if not serving.engine.is_running:
        return _dead(serving.engine).to_response()
    if isinstance(serving.engine, AsyncMPEngine):
        unresponsive = serving.engine.unresponsive_message()
        if unresponsive is not None:
            error = OpenAIError(
                unresponsive, status_code=503, type="server_error", code="engine_unresponsive"
            )
            return error.to_response()
    return Response(status_code=200)


@router.get("/metrics", response_class=PlainTextResponse)
async def prometheus_metrics(raw_request: Request) -> Response:
    metrics = _serving(raw_request).metrics
    body = metrics.render() if metrics is not None else b""
    return Response(body, media_type=CONTENT_TYPE)


@router.get("/version", responses=route_responses(VersionResponse))
async def version() -> Response:
    return JSONResponse(VersionResponse(version=server_version()).model_dump())


@router.post("/tokenize", responses=route_responses(TokenizeResponse, MODEL_ERRORS))
async def tokenize(request: TokenizeRequest, raw_request: Request) -> Response:
    response = await _serving(raw_request).tokenization.tokenize(request)
    return JSONResponse(response.model_dump())


@router.post("/detokenize", responses=route_responses(DetokenizeResponse, MODEL_ERRORS))
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> Response:
    response = await _serving(raw_request).tokenization.detokenize(request)
    return JSONResponse(response.model_dump())


@router.post("/v1/responses", responses=route_responses(ResponseObject, GENERATION_ERRORS, stream=True))
async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
    serving = _generating(raw_request, "/v1/responses")
    return await serving.responses.create_response(request, raw_request)


STORED_ERRORS = {
    404: "No stored response has this id for this API key (or the model does not exist).",
    400: "The request is invalid (the field is named in param).",
}


@router.get("/v1/responses/{response_id}", responses=route_responses(ResponseObject, STORED_ERRORS))
async def retrieve_response(response_id: str, raw_request: Request) -> Response:
    serving = _generating(raw_request, "/v1/responses")
    return await serving.responses.retrieve(response_id, raw_request)


@router.delete("/v1/responses/{response_id}", responses=route_responses(ResponseDeleted, STORED_ERRORS))
async def delete_response(response_id: str, raw_request: Request) -> Response:
    serving = _generating(raw_request, "/v1/responses")
    return await serving.responses.delete(response_id, raw_request)


@router.post("/v1/responses/{response_id}/cancel", responses=route_responses(ResponseObject, STORED_ERRORS))
async def cancel_response(response_id: str, raw_request: Request) -> Response:
    serving = _generating(raw_request, "/v1/responses")
    return await serving.responses.cancel(response_id, raw_request)


@router.get(
    "/v1/responses/{response_id}/input_items", responses=route_responses(InputItemList, STORED_ERRORS)
)
async def list_input_items(response_id: str, raw_request: Request) -> Response:
    serving = _generating(raw_request, "/v1/responses")
    return await serving.responses.input_items(response_id, raw_request)


def build_app(
    engine: AsyncEngineClient,
    settings: ServerSettings,
    metrics: EngineMetrics | None = None,
    state: ServerState | None = None,
) -> FastAPI:
    """Build the FastAPI app serving ``engine``; the engine thread and the tokenizer threads start
    and stop with the app."""
    state = state or ServerState()
    info = engine.info
    limits = settings.limits.resolve(
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        max_num_seqs=info.max_num_seqs or None,  # 0: an engine that states no limit
    )
    preprocessor = Preprocessor(
        engine.tokenizer, limits, trust_request_chat_template=settings.trust_request_chat_template
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await app.state.serving.responses.shutdown()
            preprocessor.shutdown()
            await asyncio.to_thread(engine.shutdown)
            app.state.serving.response_store.close()

    docs: dict[str, Any] = {}
    if settings.disable_fastapi_docs:
        docs = {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(
        title="pagedllm OpenAI-compatible server", version=server_version(), lifespan=lifespan, **docs
    )
    names = settings.served_model_names
    _warn_if_tools_cannot_render(settings, engine.tokenizer)
    shared: dict[str, Any] = {
        "max_logprobs": settings.max_logprobs,
        "tokenizer": private_tokenizer(engine.tokenizer),
        "preprocessor": preprocessor,
        "lora_modules": settings.lora_modules,
    }
    app.state.serving = Serving(
        engine=engine,
        state=state,
        metrics=metrics,
        served_model_names=list(names),
        completion=OpenAIServingCompletion(engine, names, **shared),
        chat=OpenAIServingChat(
            engine,
            names,
            tool_parser=settings.tool_call_parser,
            enable_auto_tool_choice=settings.enable_auto_tool_choice,
            reasoning_parser=settings.reasoning_parser,
            **shared,
        ),
        tokenization=OpenAIServingTokenization(engine, names, **shared),
        embedding=OpenAIServingEmbedding(engine, names, **shared),
        response_store=ResponseStore(settings.responses_store_dir, settings.responses_store),
    )
    app.state.serving_settings = settings
    app.add_middleware(GuardMiddleware, settings=settings, state=state)
    install_error_handlers(app)
    app.include_router(router)
    if settings.runtime_lora_updating:
        app.include_router(lora_router)
    if not settings.disable_dashboard:
        app.include_router(dashboard_router)
    return app


def _dead(engine: AsyncEngineClient) -> OpenAIError:
    return OpenAIError(engine.dead_message(), status_code=503, type="server_error", code="engine_dead")


class GracefulServer(uvicorn.Server):
    """A uvicorn server that drains in-flight requests on SIGTERM/SIGINT before it exits."""

    def __init__(
        self,
        config: uvicorn.Config,
        state: ServerState,
        engine: AsyncEngineClient,
        shutdown_timeout: float,
        early_signal: Callable[[], int | None] | None = None,
    ) -> None:
        super().__init__(config)
        self.early_signal = early_signal
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
        early = self.early_signal() if self.early_signal is not None else None
        if early is not None:
            self.handle_exit(early, None)
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

    def stop_after_engine_death(self, exc: BaseException, grace_s: float = 1.0) -> None:
        """Exit ``grace_s`` seconds after the engine died (thread-safe): the requests in flight get
        their errors first; the process then exits non-zero so that a supervisor restarts it."""
        logger.error("The engine died (%r): the server exits in %.1f s.", exc, grace_s)
        loop = self._loop
        if loop is None:
            self.should_exit = True
            return

        def stop() -> None:
            self.should_exit = True

        loop.call_soon_threadsafe(loop.call_later, grace_s, stop)

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


def _warn_if_tools_cannot_render(settings: ServerSettings, tokenizer: Any) -> None:
    """A start-up warning when tool flags are given but no template renders tools: requests with
    ``tools`` will be refused (400 on ``tools``)."""
    if not (settings.enable_auto_tool_choice or settings.tool_call_parser):
        return
    own = getattr(tokenizer, "chat_template", None)
    if not template_handles_tools(own) and tools_template(tokenizer) is None:
        logger.warning(
            "Tool calling is enabled (--enable-auto-tool-choice / --tool-call-parser), but the chat template "
            "does not render tools, so requests with tools will be refused: give --chat-template FILE "
            "naming a template with a tools section."
        )


def serve_engine(
    args: argparse.Namespace,
    engine: AsyncEngineClient,
    served_names: list[str],
    max_logprobs: int,
    metrics: EngineMetrics,
    sock: socket.socket | None = None,
    early_signal: Callable[[], int | None] | None = None,
) -> int:
    """Serve ``engine`` over HTTP (on ``sock`` when given, else on ``--host``/``--port``) until
    SIGTERM/SIGINT or the engine's death; returns the exit status (1 when the engine failed).
    ``early_signal()``: a SIGTERM/SIGINT the caller caught before the server's handlers were in
    place (None if none); the server then stops as if it came after them."""
    server: GracefulServer | None = None

    def engine_died(exc: BaseException) -> None:
        # From the engine's thread: let the failed requests' responses go out, then exit non-zero.
        if server is not None:
            server.stop_after_engine_death(exc)

    engine.on_death = engine_died
    settings = settings_from_args(args, served_names, max_logprobs)
    state = ServerState()
    app = build_app(engine, settings, metrics, state)
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=args.timeout_keep_alive,
        # h11 with read deadlines for each request's head and body (whatever uvicorn would pick).
        http=timed_h11_protocol(settings.request_read_timeout),
    )
    server = GracefulServer(uv_config, state, engine, args.shutdown_timeout, early_signal)
    logger.info(
        "Serving %s (max_model_len %d) on http://%s:%d",
        ", ".join(served_names),
        engine.info.max_model_len,
        args.host,
        args.port,
    )
    server.run(sockets=[sock] if sock is not None else None)
    engine.shutdown()
    if engine.failure is not None:
        logger.error("Server stopped because the engine failed: %r", engine.failure)
        return 1
    logger.info("Server stopped.")
    return 0
