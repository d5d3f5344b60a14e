"""An asyncio front end to the synchronous engine, for the HTTP server.

The :class:`~pagedllm.engine.llm_engine.LLMEngine` is driven by one background thread, the only
thread that ever touches it. Callers on the event loop hand it commands (add, abort, stop, a
snapshot) through a thread-safe queue; the thread blocks on it while the engine has nothing to do,
else alternates between applying pending commands and running one step. Each request has an
``asyncio.Queue`` on the caller's loop that the thread feeds with ``loop.call_soon_threadsafe``.

Errors reach the caller instead of being lost: a request the engine rejects (``ValueError`` from
``add_request``) or a full waiting queue (:class:`QueueFullError`) is raised from
:meth:`AsyncLLMEngine.add_request`; if the engine thread dies, every pending and future request gets
an :class:`EngineDeadError`. A caller that stops iterating (a disconnected client, a cancelled task)
aborts its request, which frees its KV-cache blocks at the next command pass.

An engine with ``task == "embed"`` is stepped with ``step_pooling``; its requests are submitted with
:meth:`AsyncLLMEngine.encode`, which returns the embedding.

A request's ``priority`` is checked against the engine's policy on the caller's side, before it is
handed on: a bad one raises ``ValueError`` naming ``priority`` and leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pagedllm.engine.beam_search import BeamSearchOutput, BeamSearchRun
from pagedllm.engine.core_protocol import check_wire_priority
from pagedllm.engine.engine_state import EngineCall, EngineStateAccess
from pagedllm.engine.errors import (
    EngineDeadError,
    QueueFullError,
    RequestAbortedError,
    RequestError,
    grammar_timeout_error,
    queue_full_error,
)
from pagedllm.engine.metrics import EngineMetrics, RequestTimes, StatLogger
from pagedllm.engine.stats import EngineStats
from pagedllm.outputs import EmbeddingRequestOutput, Logprob, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

logger = logging.getLogger(__name__)

# What a step hands to a request's caller: a generation snapshot, or an embedding (task "embed").
EngineOutput = RequestOutput | EmbeddingRequestOutput


class SyncEngine(Protocol):
    """What the async front end needs from the synchronous engine."""

    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def step_pooling(self) -> list[EmbeddingRequestOutput]: ...  # engines whose task is "embed"

    def abort_request(self, request_id: str | Iterable[str]) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def get_stats(self) -> EngineStats: ...

    def pop_token_intervals(self) -> list[float]: ...


class _Stream:
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


def _put_outputs(deliveries: list[tuple[_Stream, EngineOutput]]) -> None:
    """On a loop: hand one step's outputs to their streams' queues."""
    for stream, output in deliveries:
        stream.queue.put_nowait(output)


@dataclass
class _Add:
    stream: _Stream
    prompt: str | list[int]
    params: SamplingParams | PoolingParams
    priority: int = 0


@dataclass
class _Abort:
    request_ids: list[str]

    def apply(self, engine: SyncEngine) -> None:
        engine.abort_request(self.request_ids)


class _Stop: ...


_Command = _Add | _Abort | _Stop | EngineCall


class AsyncLLMEngine(EngineStateAccess):
    """Runs a synchronous engine in a background thread and serves it to asyncio callers.

    ``max_queued_requests`` bounds the number of sequences waiting to be scheduled (None = unbounded;
    a request with ``n`` > 1 counts ``n``); a request that would exceed it is refused with
    :class:`QueueFullError`. A structured-output grammar is compiled on a worker thread before the
    request reaches the engine thread (which then finds it in the grammar cache), so a slow grammar
    stalls no other request; one that takes longer than ``grammar_compile_timeout`` seconds is refused.
    """

    def __init__(
        self,
        engine: SyncEngine,
        *,
        max_queued_requests: int | None = None,
        metrics: EngineMetrics | None = None,
        log_stats_interval: float | None = 5.0,
        grammar_compile_timeout: float = 10.0,
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        if max_queued_requests is not None and max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be non-negative, got {max_queued_requests}.")
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.grammar_compile_timeout = grammar_compile_timeout
        # Called from the engine thread after a failure has been reported to every request.
        self.on_death = on_death
        self.failure: BaseException | None = None  # what stopped the engine thread, if it failed
        self.metrics = metrics
        self._stat_logger = StatLogger(log_stats_interval) if log_stats_interval else None
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        # Streams of requests that are queued or running; guarded by ``_lock``.
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._dead: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._started = False
        self._ids = itertools.count()
        self._latest_stats = EngineStats()

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: Any) -> AsyncLLMEngine:
        """Build the synchronous engine from ``config`` and wrap it."""
        from pagedllm.engine.llm_engine import LLMEngine

        return cls(LLMEngine.from_config(config), **kwargs)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()
        self._started = True

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still in flight fail with :class:`EngineDeadError`."""
        if self._thread is None:
            return
        self._commands.put(_Stop())
        self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive and has not failed."""
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def dead_error(self) -> BaseException | None:
        """The exception that stopped the engine thread, if it stopped."""
        return self._dead

    @property
    def num_active_requests(self) -> int:
        """Requests accepted or pending acceptance that have not finished or been aborted."""
        with self._lock:
            return len(self._streams)

    @property
    def scheduling_policy(self) -> str:
        """The scheduling policy of the engine served: the one its cores reported (an engine in core
        processes), else the engine's configured one; ``fcfs`` for an engine that states none."""
        reported = getattr(self.engine, "scheduling_policy", None)
        if isinstance(reported, str):
            return reported
        return str(getattr(getattr(self.engine, "config", None), "scheduling_policy", "fcfs"))

    def check_priority(self, priority: object) -> None:
        """Raise ValueError naming ``priority`` unless it is an integer the engine's policy takes
        (any under ``priority``, only 0 under ``fcfs``) and a message to a core can carry."""
        from pagedllm.engine.llm_engine import check_priority

        check_wire_priority(priority)
        check_priority(priority, self.scheduling_policy)

    @property
    def stats(self) -> EngineStats:
        """The engine's statistics as of the end of the latest engine-thread iteration."""
        return self._latest_stats

    # ------------------------------------------------------------------ caller side

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    async def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and wait until the engine has accepted it.

        Raises the engine's ``ValueError`` for an invalid request (a bad ``priority`` at once),
        :class:`QueueFullError` when the waiting queue is full and :class:`EngineDeadError` when the
        engine is not running. Returns an iterator of the request's cumulative outputs, ending with
        the finished one; closing or abandoning the iterator early aborts the request.
        """
        self.check_priority(priority)
        if params.structured_outputs is not None:
            await self._compile_grammar(params)
        return self._iterate(await self._submit(request_id, prompt, params, priority))

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
        self, request_id: str, prompt: str | list[int], params: SamplingParams | PoolingParams, priority: int
    ) -> _Stream:
        """Hand a request to the engine thread and wait until the engine has accepted it."""
        stream = _Stream(request_id, asyncio.get_running_loop())
        if isinstance(prompt, list):
            stream.times.num_prompt_tokens = len(prompt)
        with self._lock:
            if self._dead is not None or not self._started:
                raise EngineDeadError(self.dead_message())
            if request_id in self._streams:
                raise RequestError("request_id", f"request_id {request_id!r} is already in use.")
            self._streams[request_id] = stream
            self._send(_Add(stream, prompt, params, priority))
        try:
            await stream.accepted
        except BaseException:
            self.abort(request_id)
            raise
        return stream

    async def _compile_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar off the engine thread (into the engine's grammar cache)."""
        manager = getattr(self.engine, "structured_output_manager", None)
        if manager is None or params.structured_outputs is None:
            return
        task = asyncio.ensure_future(asyncio.to_thread(manager.compile, params.structured_outputs))
        try:
            await asyncio.wait_for(asyncio.shield(task), self.grammar_compile_timeout)
        except TimeoutError:
            # The compilation cannot be interrupted: it finishes in its thread and is cached.
            task.add_done_callback(lambda t: t.exception())
            raise grammar_timeout_error(self.grammar_compile_timeout) from None

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its cumulative outputs until it finishes."""
        outputs = await self.add_request(request_id or self.new_request_id(), prompt, params, priority)
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
            max_model_len=self.engine.max_model_len,
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

    async def _iterate(self, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                # Outputs are cumulative: when the caller fell behind, only the newest one matters.
                while isinstance(item, RequestOutput) and not item.finished and not stream.queue.empty():
                    item = stream.queue.get_nowait()
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
                self._send(_Abort(live))

    def abort_all(self, message: str = "The request was aborted by the server.") -> int:
        """Abort every request in flight; their callers get :class:`RequestAbortedError`."""
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
            if streams and self._dead is None:
                self._send(_Abort([s.request_id for s in streams]))
        for s in streams:
            s.fail(RequestAbortedError(message))
        return len(streams)

    def _send(self, command: _Command) -> None:
        """Hand a command to whatever runs the engine (here: the engine thread's queue). Called with
        ``_lock`` held, so that commands keep the order of the calls that made them."""
        self._commands.put(command)

    def dead_message(self) -> str:
        if self._dead is None:
            return "The engine is not running."
        return f"The engine has stopped: {type(self._dead).__name__}: {self._dead}"

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        engine = self.engine
        step = engine.step_pooling if getattr(engine, "task", "generate") == "embed" else engine.step
        try:
            idle = True
            while True:
                busy = engine.has_unfinished_requests()
                commands = self._next_commands(block=not busy)
                if self._apply(commands):
                    break
                if not engine.has_unfinished_requests():
                    if commands:
                        self._record_stats(log=False)
                    idle = True
                    continue
                if idle and self._stat_logger is not None:
                    self._stat_logger.reset(self._latest_stats)
                idle = False
                outputs = step()
                self._dispatch(outputs)
                if self.metrics is not None:
                    observe = self.metrics.inter_token_latency.observe
                    for interval in engine.pop_token_intervals():
                        observe(interval)
                self._record_stats(log=True)
        except BaseException as exc:  # noqa: BLE001 - any failure must reach the waiting callers
            logger.exception("The engine loop failed; no further requests can be served.")
            self.failure = exc
            self._fail_everything(exc)
            if self.on_death is not None:
                self.on_death(exc)
            return
        self._fail_everything(None)

    def _next_commands(self, *, block: bool) -> list[_Command]:
        commands: list[_Command] = []
        if block:
            commands.append(self._commands.get())
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, commands: list[_Command]) -> bool:
        """Apply commands in order; returns True when asked to stop."""
        waiting: int | None = None
        for cmd in commands:
            if isinstance(cmd, _Stop):
                return True
            if not isinstance(cmd, _Add):  # an abort, or a call to run between steps
                cmd.apply(self.engine)
                continue
            stream = cmd.stream
            with self._lock:
                if self._streams.get(stream.request_id) is not stream:
                    continue  # aborted before it reached the engine
            if self.max_queued_requests is not None:
                if waiting is None:
                    waiting = self.engine.get_stats().num_waiting
                # The bound counts sequences: a request with n = 4 queues four.
                n = cmd.params.n if isinstance(cmd.params, SamplingParams) else 1
                if waiting + n > self.max_queued_requests:
                    self._drop(stream)
                    stream.fail(queue_full_error(waiting, n, self.max_queued_requests))
                    continue
            try:
                self.engine.add_request(
                    stream.request_id, cmd.prompt, cmd.params, stream.times.arrival, priority=cmd.priority
                )
            except Exception as exc:  # noqa: BLE001 - rejected requests report to their caller
                self._drop(stream)
                stream.fail(exc)
                continue
            if waiting is not None:
                waiting += cmd.params.n if isinstance(cmd.params, SamplingParams) else 1
            stream.accept()
        return False

    def _drop(self, stream: _Stream) -> None:
        with self._lock:
            if self._streams.get(stream.request_id) is stream:
                del self._streams[stream.request_id]

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
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, EngineOutput]]] = {}
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

    def _record_stats(self, *, log: bool) -> None:
        stats = self.engine.get_stats()
        self._latest_stats = stats
        if self.metrics is not None:
            self.metrics.record_stats(stats)
        if log and self._stat_logger is not None:
            self._stat_logger.maybe_log(stats)

    def _fail_everything(self, exc: BaseException | None) -> None:
        """Mark the engine dead and fail every request in flight or still in the command queue."""
        with self._lock:
            self._dead = exc if exc is not None else EngineDeadError("the engine was shut down")
            streams = list(self._streams.values())
            self._streams.clear()
        message = self.dead_message()
        for s in streams:
            s.fail(EngineDeadError(message))


__all__ = [
    "AsyncLLMEngine",
    "EngineDeadError",
    "EngineOutput",
    "QueueFullError",
    "RequestAbortedError",
    "SyncEngine",
]
