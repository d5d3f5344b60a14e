"""The caller's side of an engine for asyncio: per-request streams, whatever transport serves them.

:class:`AsyncEngineClient` is what the HTTP server talks to. A request gets a :class:`RequestStream`: an
acceptance future and an ``asyncio.Queue`` of outputs on the caller's loop, fed from the transport's
thread with ``loop.call_soon_threadsafe``. The two transports are its subclasses:
:class:`~pagedllm.engine.async_engine.AsyncLLMEngine` (an :class:`~pagedllm.engine.engine_core.EngineCore`
on a thread of this process) and :class:`~pagedllm.engine.proc.async_mp_engine.AsyncMPEngine` (engine
cores in other processes, through a :class:`~pagedllm.engine.proc.core_client.CoreClient`). A subclass
sends adds and aborts (:meth:`AsyncEngineClient._send_add`, :meth:`AsyncEngineClient._send_abort`)
and reports back with :meth:`AsyncEngineClient._accept`, :meth:`AsyncEngineClient._reject`,
:meth:`AsyncEngineClient._dispatch` and :meth:`AsyncEngineClient._fail_everything`.

Errors reach the caller instead of being lost: a refused request raises its
:class:`~pagedllm.errors.RequestError` (a full waiting queue: :class:`~pagedllm.errors.QueueFullError`)
from :meth:`AsyncEngineClient.add_request`; when the engine stops, every pending and future request
gets an :class:`~pagedllm.engine.errors.EngineDeadError`. A caller that stops iterating (a
disconnected client, a cancelled task) aborts its request. A request's ``priority`` is checked on the
caller's side, against the policy the engine reported, before it is sent.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

from pagedllm.engine.beam_search import BeamSearchOutput, BeamSearchRun
from pagedllm.engine.delta_outputs import merge_deltas
from pagedllm.engine.engine_checks import check_new_request_id, check_priority
from pagedllm.engine.engine_core import EngineOutput
from pagedllm.engine.engine_info import EngineInfo
from pagedllm.engine.errors import EngineDeadError, RequestAbortedError
from pagedllm.engine.observe.metrics import EngineMetrics, RequestTimes
from pagedllm.engine.observe.stats import EngineStats
from pagedllm.engine.observe.step_events import StepRecord
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import EmbeddingRequestOutput, Logprob, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class RequestStream:
    """The caller-side end of one request: an acceptance future and a queue of outputs.

    Only the loop's thread touches ``accepted`` and ``queue``; the engine thread reaches them through
    ``call_soon_threadsafe``: :meth:`accept` and :meth:`fail` one call each, outputs one call per
    loop and step (see :func:`_put_outputs`)."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.accepted: asyncio.Future[None] = loop.create_future()
        self.queue: asyncio.Queue[EngineOutput | BaseException] = asyncio.Queue()
        # Timing, touched by the engine thread only.
        self.times = RequestTimes(time.monotonic())

    def _call(self, fn: Any, *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def accept(self) -> None:
        self._call(self._accept_on_loop)

    def _accept_on_loop(self) -> None:
        if not self.accepted.done():
            self.accepted.set_result(None)

    def fail(self, exc: BaseException) -> None:
        """Raise ``exc`` to the caller: from ``add_request`` if not yet accepted, else from iteration."""
        self._call(self._fail_on_loop, exc)

    def _fail_on_loop(self, exc: BaseException) -> None:
        if not self.accepted.done():
            self.accepted.set_exception(exc)
            # Mark the exception retrieved if the waiter has gone, to avoid an "unretrieved" warning.
            self.accepted.add_done_callback(lambda f: f.exception())
        else:
            self.queue.put_nowait(exc)


def _put_outputs(deliveries: list[tuple[RequestStream, EngineOutput]]) -> None:
    """On a loop: hand one step's outputs to their streams' queues."""
    for stream, output in deliveries:
        stream.queue.put_nowait(output)


class AsyncEngineClient:
    """Async requests to one engine, over a transport its subclass provides (see the module
    docstring). ``max_queued_requests`` is the engine's waiting-queue bound, known here for the
    front-end's own checks (the engine core enforces it)."""

    # What the front-end knows of the engine (set by the subclass): its description, and the
    # tokenizer of the front-end (the engine's own, in this process).
    info: EngineInfo
    tokenizer: Any

    def __init__(
        self,
        *,
        metrics: EngineMetrics | None = None,
        on_death: Callable[[BaseException], None] | None = None,
        max_queued_requests: int | None = None,
    ) -> None:
        if max_queued_requests is not None and max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be non-negative, got {max_queued_requests}.")
        self.max_queued_requests = max_queued_requests
        # Called from the transport's thread after a failure has been reported to every request.
        self.on_death = on_death
        self.failure: BaseException | None = None  # what stopped the engine, if it failed
        self.metrics = metrics
        # Streams of requests that are queued or running; guarded by ``_lock``.
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._dead: BaseException | None = None
        self._started = False
        self._ids = itertools.count()
        self._latest_stats = EngineStats()

    # ------------------------------------------------------------------ the transport's part

    def start(self) -> None:
        raise NotImplementedError

    def shutdown(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    @property
    def is_running(self) -> bool:
        raise NotImplementedError

    def _send_add(
        self,
        stream: RequestStream,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        priority: int,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Hand a request on (called with ``_lock`` held, so that commands keep the callers' order)."""
        raise NotImplementedError

    def _send_abort(self, request_ids: list[str]) -> None:
        """Abort requests the engine may hold (called with ``_lock`` held)."""
        raise NotImplementedError

    # The dashboard's data (see :class:`~pagedllm.engine.observe.engine_state.EngineStateAccess`).

    @property
    def engine_ranks(self) -> list[int]:
        """The engines whose state can be asked for."""
        raise NotImplementedError

    async def engine_state(self, rank: int = 0) -> bytes:
        """Engine ``rank``'s snapshot, taken between two steps (JSON)."""
        raise NotImplementedError

    def step_records(self, since: int, limit: int | None = None, rank: int = 0) -> list[StepRecord]:
        """Engine ``rank``'s step records after step ``since`` (the latest ``limit``), oldest first."""
        raise NotImplementedError

    # ------------------------------------------------------------------ state

    @property
    def dead_error(self) -> BaseException | None:
        """The exception that stopped the engine, if it stopped."""
        return self._dead

    @property
    def num_active_requests(self) -> int:
        """Requests accepted or pending acceptance that have not finished or been aborted."""
        with self._lock:
            return len(self._streams)

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def scheduling_policy(self) -> str:
        """The engine's scheduling policy (which decides the priorities a request may have)."""
        return self.info.scheduling_policy

    def check_priority(self, priority: object) -> None:
        """Raise RequestError naming ``priority`` unless it is an integer the engine's policy takes
        (any under ``priority``, only 0 under ``fcfs``) and a message to a core can carry."""
        check_priority(priority, self.scheduling_policy)

    @property
    def stats(self) -> EngineStats:
        """The engine's latest statistics (the sum over its cores)."""
        return self._latest_stats

    def dead_message(self) -> str:
        if self._dead is None:
            return "The engine is not running."
        return f"The engine has stopped: {type(self._dead).__name__}: {self._dead}"

    # ------------------------------------------------------------------ caller side

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and wait until the engine has accepted it.

        Raises the engine's ``ValueError`` for an invalid request (a bad ``priority`` at once),
        :class:`QueueFullError` when the waiting queue is full and :class:`EngineDeadError` when the
        engine is not running. Returns an iterator of the request's outputs as ``params.output_kind``
        asks (cumulative ones, or with ``DELTA`` what each adds, or only the final one), ending with
        the finished one; closing or abandoning the iterator early aborts the request.
        """
        self.check_priority(priority)
        return self._iterate(await self._submit(request_id, prompt, params, priority, lora_request))

    async def encode(
        self, request_id: str, prompt: list[int], params: PoolingParams, priority: int = 0
    ) -> EmbeddingRequestOutput:
        """Submit a pooling request (an engine whose task is ``embed``) and wait for its embedding.

        Raises as :meth:`add_request` does; cancelling the wait aborts the request.
        """
        self.check_priority(priority)
        stream = await self._submit(request_id, prompt, params, priority)
        try:
            item = await stream.queue.get()
        except BaseException:
            self.abort(request_id)
            raise
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, EmbeddingRequestOutput), "a pooling request got a generation output"
        return item

    async def _submit(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        priority: int,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Hand a request to the engine thread and wait until the engine has accepted it."""
        stream = RequestStream(request_id, asyncio.get_running_loop())
        stream.times.delta = (
            isinstance(params, SamplingParams) and params.output_kind is RequestOutputKind.DELTA
        )
        if isinstance(prompt, list):
            stream.times.num_prompt_tokens = len(prompt)
        with self._lock:
            if self._dead is not None or not self._started:
                raise EngineDeadError(self.dead_message())
            check_new_request_id(request_id, self._streams)
            self._streams[request_id] = stream
            self._send_add(stream, prompt, params, priority, lora_request)
        try:
            await stream.accepted
        except BaseException:
            self.abort(request_id)
            raise
        return stream

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs (as ``params.output_kind`` asks) until it finishes."""
        rid = request_id or self.new_request_id()
        outputs = await self.add_request(rid, prompt, params, priority, lora_request)
        async for output in outputs:
            yield output

    async def beam_search(
        self,
        prompts: Sequence[tuple[str | None, list[int]]],
        params: BeamSearchParams,
        *,
        eos_token_ids: Sequence[int],
        max_logprobs: int,
        request_id: str | None = None,
        priority: int = 0,
    ) -> list[BeamSearchOutput]:
        """Beam search over ``(text, token_ids)`` prompts, scored as :func:`pagedllm.engine.beam_search.beam_search`.

        Each step submits the one-token request of every live beam concurrently, so they share engine
        steps with each other and with other requests. The hypotheses' text is not decoded (the engine's
        tokenizer belongs to the engine thread). Raises ValueError for invalid prompts or parameters and
        the errors of :meth:`add_request`; a failed or cancelled search aborts its pending requests.
        Every one-token request of the search has ``priority``.
        """
        self.check_priority(priority)
        run = BeamSearchRun(
            prompts,
            params,
            eos_token_ids=eos_token_ids,
            max_logprobs=max_logprobs,
            max_model_len=self.max_model_len,
        )
        prefix = request_id or self.new_request_id("beam")
        counter = itertools.count()
        while not run.done:
            ids = [(f"{prefix}-{next(counter)}", tokens) for tokens in run.step_prompts()]
            try:
                tops = await asyncio.gather(
                    *(
                        self._next_token_logprobs(rid, tokens, run.step_params, priority)
                        for rid, tokens in ids
                    )
                )
            except BaseException:
                self.abort([rid for rid, _ in ids])
                raise
            run.advance(tops)
        return run.outputs()

    async def _next_token_logprobs(
        self, request_id: str, tokens: list[int], params: SamplingParams, priority: int = 0
    ) -> dict[int, Logprob]:
        """The top next-token log probabilities after ``tokens`` (a one-token request)."""
        final: RequestOutput | None = None
        async for out in self.generate(tokens, params, request_id=request_id, priority=priority):
            final = out
        logprobs = final.outputs[0].logprobs if final is not None else None
        if not logprobs:
            raise RuntimeError(f"beam search step request {request_id!r} returned no logprobs")
        return logprobs[0]

    async def _iterate(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                # A caller that fell behind gets one output for the ones queued: the newest one of
                # cumulative outputs, deltas merged.
                while isinstance(item, RequestOutput) and not item.finished and not stream.queue.empty():
                    newer = stream.queue.get_nowait()
                    delta = stream.times.delta and isinstance(newer, RequestOutput)
                    item = merge_deltas(item, newer) if delta else newer  # type: ignore[arg-type]
                if isinstance(item, BaseException):
                    finished = True  # the engine side already dropped the request
                    raise item
                assert isinstance(item, RequestOutput), "a generation request got a pooling output"
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(stream.request_id)

    def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); their blocks are freed promptly."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._lock:
            live = [rid for rid in ids if self._streams.pop(rid, None) is not None]
            if live and self._dead is None:
                self._send_abort(live)

    def abort_all(self, message: str = "The request was aborted by the server.") -> int:
        """Abort every request in flight; their callers get :class:`RequestAbortedError`."""
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
            if streams and self._dead is None:
                self._send_abort([s.request_id for s in streams])
        for s in streams:
            s.fail(RequestAbortedError(message))
        return len(streams)

    # ------------------------------------------------------------------ the transport's reports

    def _accept(self, request_id: str) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.accept()

    def _reject(self, request_id: str, exc: BaseException) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.fail(exc)

    def _dispatch(self, outputs: Sequence[EngineOutput]) -> None:
        """Hand a step's outputs to their streams: one ``call_soon_threadsafe`` per event loop (each
        call wakes the loop through a pipe), after updating the latency metrics."""
        if not outputs:
            return
        now = time.monotonic()
        metrics = self.metrics
        streams = self._streams
        with self._lock:
            pairs = [(streams.get(out.request_id), out) for out in outputs]
            for stream, out in pairs:
                if stream is not None and out.finished:
                    del streams[out.request_id]
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, EngineOutput]]] = {}
        for stream, out in pairs:
            if stream is None:
                continue  # aborted meanwhile
            by_loop.setdefault(stream.loop, []).append((stream, out))
            if metrics is not None:
                metrics.observe_output(stream.times, out, now)
        for loop, deliveries in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_outputs, deliveries)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _fail_everything(self, exc: BaseException | None) -> None:
        """Mark the engine dead and fail every request in flight or still in the command queue."""
        with self._lock:
            self._dead = exc if exc is not None else EngineDeadError("the engine was shut down")
            streams = list(self._streams.values())
            self._streams.clear()
        message = self.dead_message()
        for s in streams:
            s.fail(EngineDeadError(message))


__all__ = ["AsyncEngineClient", "EngineDeadError", "EngineOutput", "RequestAbortedError"]
