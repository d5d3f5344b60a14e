"""The engine-core process: one :class:`~pagedllm.engine.llm_engine.LLMEngine` and its step loop,
served to front-end processes over ZeroMQ.

Two threads share the process:

* the **step loop** (the main thread) is the only one that touches the engine: it applies the
  commands the I/O thread queued (add, abort, shutdown), runs a step when requests are unfinished,
  and hands each front-end one :class:`~pagedllm.engine.core_protocol.CoreOutputs` per iteration
  (acceptances, rejections, output deltas, stats) through an in-process socket;
* the **I/O thread** owns the sockets to the front-ends: it decodes incoming messages into
  commands (a request with a grammar is first compiled on a worker thread, so a slow grammar never
  stalls a step), forwards the step loop's messages, and sends a heartbeat whenever the step loop
  has said nothing for :data:`HEARTBEAT_S` (a long forward included), so that front-ends can tell a
  busy core from a dead one.

Start-up: the core connects a DEALER socket to front-end 0, loads the model, and says
:class:`Hello`; front-end 0 answers with every front-end's address and the core connects to (and
greets) the others. A core whose model fails to load says :class:`StartFailed` and exits 1. A core
whose step raises says :class:`CoreDead` (naming the exception) to every front-end and exits 1. It
exits 0 on :class:`Shutdown`, on SIGTERM, when no front-end has been heard from for
:data:`FRONTEND_TIMEOUT_S`, or when the process that started it has exited.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import zmq

from pagedllm.engine.core_protocol import (
    AbortRequests,
    AddRequest,
    Codec,
    CoreDead,
    CoreOutputs,
    EmbeddingResult,
    EngineInfo,
    EngineStateQuery,
    Hello,
    Ping,
    ResetPrefixCache,
    Shutdown,
    StartFailed,
    Welcome,
    rejection,
    undecodable_request,
)
from pagedllm.engine.engine_state import encode_state
from pagedllm.engine.errors import RequestError, as_request_error, grammar_timeout_error, queue_full_error
from pagedllm.engine.metrics import StatLogger
from pagedllm.engine.output_deltas import DeltaEncoder, metrics_times
from pagedllm.outputs import EmbeddingRequestOutput, RequestOutput

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger("pagedllm.core")

# The I/O thread says something at least this often (seconds).
HEARTBEAT_S = 0.2
# A core with no word from any front-end for this long exits (its front-ends are gone).
FRONTEND_TIMEOUT_S = 30.0


@dataclass
class CoreOptions:
    """How a core process runs (besides the engine arguments)."""

    rank: int  # data-parallel rank
    frontend_address: str  # front-end 0's socket, e.g. tcp://127.0.0.1:5570
    max_queued_requests: int | None = None
    grammar_compile_timeout: float = 10.0
    log_stats_interval: float | None = 5.0
    report_cache_events: bool = False  # send prefix-cache registrations/evictions (data parallel)
    log_level: str = "info"


def engine_info(engine: LLMEngine) -> EngineInfo:
    config = engine.config
    pooling = None
    if engine.task == "embed":
        pc = engine.pooling_config
        pooling = (pc.pooling_type, pc.normalize, pc.hidden_size, pc.matryoshka_dimensions)
    return EngineInfo(
        model_name=str(engine.model_name),
        task=engine.task,
        max_model_len=int(engine.max_model_len),
        vocab_size=int(engine.vocab_size),
        eos_token_ids=list(engine.eos_token_ids),
        default_sampling=dict(engine.default_sampling),
        block_size=config.block_size,
        num_kv_blocks=engine.kv_cache_manager.pool.num_blocks,
        max_num_seqs=config.max_num_seqs,
        max_logprobs=config.max_logprobs,
        enable_prefix_caching=engine.kv_cache_manager.enable_caching,
        pooling=pooling,
        scheduling_policy=config.scheduling_policy,
        max_num_batched_tokens=engine.scheduler.config.max_num_batched_tokens,
    )


class _CoreIO:
    """The I/O thread's state: sockets to the front-ends, the command queue of the step loop, and
    the grammar compilations in progress."""

    def __init__(self, options: CoreOptions, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.options = options
        self.ctx = ctx
        self.codec = Codec()
        self.identity = f"core-{options.rank}".encode()
        self.dealers: list[zmq.Socket[bytes]] = [self._connect(options.frontend_address)]
        self.commands: queue.SimpleQueue[
            AddRequest | AbortRequests | Shutdown | ResetPrefixCache | EngineStateQuery
        ] = queue.SimpleQueue()
        # request id -> the front-end (index) that sent it: set by the I/O thread as the request
        # arrives (before the step loop sees it), read and dropped by the step loop (each a single
        # dict operation).
        self.owner: dict[str, int] = {}
        # The step loop's outgoing messages: (front-end index or -1 for all, payload).
        self.outbox = ctx.socket(zmq.PAIR)
        self.outbox.bind(f"inproc://core-out-{id(self)}")
        self.sender = ctx.socket(zmq.PAIR)  # used by the step loop only
        self.sender.connect(f"inproc://core-out-{id(self)}")
        self.compiler = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="pagedllm-grammar")
        self.compiling: dict[str, tuple[float, concurrent.futures.Future[object], AddRequest]] = {}
        self.stats_for_heartbeat: CoreOutputs | None = None
        self.last_sent = 0.0
        self.last_heard = time.monotonic()
        self.parent_pid = os.getppid()
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        # Compiles a request's grammar into the engine's cache (set once the engine is loaded).
        self.grammar_compile: Callable[[StructuredOutputsParams], object] | None = None

    def _connect(self, address: str) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(address)
        return sock

    # -- start-up (main thread, before the I/O thread runs) ----------------------------------

    def greet(self, info: EngineInfo, timeout: float) -> None:
        """Say Hello to front-end 0, learn the others from its Welcome, and greet them too."""
        hello = self.codec.encode(Hello(self.options.rank, info))
        self.dealers[0].send(hello)
        if not self.dealers[0].poll(int(timeout * 1000)):
            raise TimeoutError(f"front-end {self.options.frontend_address} did not answer in {timeout:g} s")
        message = self.codec.to_core.decode(self.dealers[0].recv())
        if not isinstance(message, Welcome):
            raise RuntimeError(f"expected the front-end's welcome, got {type(message).__name__}")
        for address in message.frontend_addresses[1:]:
            sock = self._connect(address)
            sock.send(hello)
            self.dealers.append(sock)

    def fail_start(self, reason: str) -> None:
        self.dealers[0].send(self.codec.encode(StartFailed(self.options.rank, reason)))

    def start(self) -> None:
        self.last_heard = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="pagedllm-core-io", daemon=True)
        self.thread.start()

    # -- the step loop's side ------------------------------------------------------------------

    def send(self, target: int, payload: bytes) -> None:
        """Queue ``payload`` for front-end ``target`` (-1: every front-end). Step loop only."""
        self.sender.send_multipart([target.to_bytes(2, "little", signed=True), payload], copy=False)

    # -- the I/O thread -----------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.outbox, zmq.POLLIN)
        for sock in self.dealers:
            poller.register(sock, zmq.POLLIN)
        decode = self.codec.to_core.decode
        while not self.stopping.is_set():
            # While grammars compile, look at them often: a compiled request waits for this loop.
            ready = dict(poller.poll(5 if self.compiling else int(HEARTBEAT_S * 500)))
            if self.outbox in ready:
                while self.outbox.poll(0):
                    target_b, payload = self.outbox.recv_multipart()
                    target = int.from_bytes(target_b, "little", signed=True)
                    targets = self.dealers if target < 0 else [self.dealers[target]]
                    for sock in targets:
                        sock.send(payload)
                    self.last_sent = time.monotonic()
            for index, sock in enumerate(self.dealers):
                if sock not in ready:
                    continue
                while sock.poll(0):
                    raw = sock.recv()
                    try:
                        message = decode(raw)
                    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                        self._undecodable(index, raw, exc)
                        continue
                    try:
                        self._handle(index, message)
                    except Exception as exc:  # noqa: BLE001 - one message never stops the core
                        logger.exception(
                            "Core %d: could not handle a %s.", self.options.rank, type(message).__name__
                        )
                        if isinstance(message, AddRequest):
                            self._reject(
                                message.request_id,
                                RequestError(None, f"The engine could not take this request: {exc}"),
                            )
                self.last_heard = time.monotonic()
            self._check_compiles()
            now = time.monotonic()
            if now - self.last_sent >= HEARTBEAT_S:
                beat = self.stats_for_heartbeat or CoreOutputs(self.options.rank, now)
                beat.core_time = now
                payload = self.codec.encode(beat)
                for sock in self.dealers:
                    sock.send(payload)
                self.last_sent = now
            if os.getppid() != self.parent_pid:
                logger.error("Core %d: the process that started it has exited; exiting.", self.options.rank)
                self.commands.put(Shutdown())
                return
            if now - self.last_heard > FRONTEND_TIMEOUT_S:
                logger.error(
                    "Core %d: no front-end heard from in %.0f s; exiting.",
                    self.options.rank,
                    FRONTEND_TIMEOUT_S,
                )
                self.commands.put(Shutdown())
                return

    def _handle(self, index: int, message: object) -> None:
        if isinstance(message, AddRequest):
            self.owner[message.request_id] = index
            sp = message.sampling
            if sp is not None and sp.structured_outputs is not None and self.grammar_compile is not None:
                future: concurrent.futures.Future[object] = self.compiler.submit(
                    self.grammar_compile, sp.structured_outputs
                )
                self.compiling[message.request_id] = (time.monotonic(), future, message)
                return
            self.commands.put(message)
        elif isinstance(message, AbortRequests):
            for rid in message.request_ids:
                entry = self.compiling.pop(rid, None)
                if entry is not None:
                    self.owner.pop(rid, None)
            self.commands.put(message)
        elif isinstance(message, Shutdown | ResetPrefixCache):
            self.commands.put(message)
        elif isinstance(message, EngineStateQuery):
            message.frontend = index
            self.commands.put(message)
        elif isinstance(message, Ping | Welcome):
            pass

    def _undecodable(self, index: int, raw: bytes, exc: Exception) -> None:
        """A message that does not decode into one of the core's types changes nothing: a request
        whose id can still be read is refused (a 400 for its client, naming the field), anything else
        is logged and dropped. The core never stops for what a front-end sent."""
        request_id, field = undecodable_request(raw, exc)
        if request_id is None:
            logger.warning("Core %d: dropped a message it cannot decode (%s).", self.options.rank, exc)
            return
        detail = str(exc).split(" - at `", 1)[0]
        if field is None or not detail.startswith("Expected"):  # the parameters' own check names it
            cause = exc.__cause__
            param = cause.param if isinstance(cause, RequestError) else None
            self._reject(request_id, RequestError(param, detail), index)
        else:
            param = field.split(".", 1)[0].split("[", 1)[0]
            self._reject(
                request_id,
                RequestError(param, f"{field}: the engine cannot take this value: {detail}."),
                index,
            )

    def _check_compiles(self) -> None:
        """Hand compiled requests to the step loop; refuse those whose grammar failed or is too slow."""
        if not self.compiling:
            return
        now = time.monotonic()
        timeout = self.options.grammar_compile_timeout
        for rid, (started, future, message) in list(self.compiling.items()):
            if future.done():
                del self.compiling[rid]
                exc = future.exception()
                if exc is None:
                    self.commands.put(message)
                else:
                    self._reject(rid, as_request_error(exc))
            elif now - started > timeout:
                del self.compiling[rid]
                self._reject(rid, grammar_timeout_error(timeout))

    def _reject(self, request_id: str, error: RequestError, index: int | None = None) -> None:
        """Refuse a request: to front-end ``index`` when given (the request's id is not taken over
        from the request in flight that may hold it), else to its owner."""
        if index is None:
            index = self.owner.pop(request_id, 0)
        out = CoreOutputs(self.options.rank, time.monotonic(), rejected=[rejection(request_id, error)])
        self.dealers[index].send(self.codec.encode(out))

    def close(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(2.0)
        self.compiler.shutdown(wait=False, cancel_futures=True)


class EngineCoreProc:
    """The step loop of one core process (see the module docstring)."""

    def __init__(self, engine: LLMEngine, io: _CoreIO, options: CoreOptions) -> None:
        self.engine = engine
        self.io = io
        self.options = options
        self.codec = Codec()
        self.deltas = DeltaEncoder()
        self.num_frontends = len(io.dealers)
        pool = engine.kv_cache_manager.pool
        pool.report_events = options.report_cache_events
        self.stat_logger = StatLogger(options.log_stats_interval) if options.log_stats_interval else None
        self.last_step = 0  # the latest step record sent to the front-ends

    def run(self) -> None:
        engine = self.engine
        io = self.io
        step = engine.step_pooling if engine.task == "embed" else engine.step
        idle = True
        while True:
            busy = engine.has_unfinished_requests()
            commands = self._next_commands(block=not busy)
            outs = self._new_outputs()
            if self._apply(commands, outs):
                return
            if engine.has_unfinished_requests():
                if idle and self.stat_logger is not None:
                    self.stat_logger.reset(engine.get_stats())
                idle = False
                for out in step():
                    self._add_output(outs, out)
            else:
                idle = True
            self._flush(outs, log=not idle)
            if io.thread is not None and not io.thread.is_alive():
                return

    # -- commands ---------------------------------------------------------------------------

    def _next_commands(
        self, *, block: bool
    ) -> list[AddRequest | AbortRequests | Shutdown | ResetPrefixCache | EngineStateQuery]:
        commands: list[AddRequest | AbortRequests | Shutdown | ResetPrefixCache | EngineStateQuery] = []
        q = self.io.commands
        if block:
            try:
                commands.append(q.get(timeout=HEARTBEAT_S))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(q.get_nowait())
            except queue.Empty:
                return commands

    def _new_outputs(self) -> list[CoreOutputs]:
        now = time.monotonic()
        return [CoreOutputs(self.options.rank, now) for _ in range(self.num_frontends)]

    def _owner(self, request_id: str) -> int:
        return self.io.owner.get(request_id, 0)

    def _apply(
        self,
        commands: list[AddRequest | AbortRequests | Shutdown | ResetPrefixCache | EngineStateQuery],
        outs: list[CoreOutputs],
    ) -> bool:
        """Apply commands in order; True when asked to stop."""
        engine = self.engine
        waiting: int | None = None
        limit = self.options.max_queued_requests
        for cmd in commands:
            if isinstance(cmd, Shutdown):
                return True
            if isinstance(cmd, EngineStateQuery):  # between two steps: one state the engine was in
                outs[min(cmd.frontend, len(outs) - 1)].state = (cmd.query_id, encode_state(engine))
                continue
            if isinstance(cmd, ResetPrefixCache):
                if not engine.reset_prefix_cache():
                    logger.warning(
                        "Core %d: the prefix cache was not reset (requests hold blocks).", self.options.rank
                    )
                continue
            if isinstance(cmd, AbortRequests):
                engine.abort_request(cmd.request_ids)
                for rid in cmd.request_ids:
                    self.deltas.forget(rid)
                    self.io.owner.pop(rid, None)
                continue
            rid = cmd.request_id
            out = outs[self._owner(rid)]
            params = cmd.sampling if cmd.sampling is not None else cmd.pooling
            n = cmd.sampling.n if cmd.sampling is not None else 1
            if limit is not None:
                if waiting is None:
                    waiting = engine.get_stats().num_waiting
                if waiting + n > limit:
                    out.rejected.append(rejection(rid, queue_full_error(waiting, n, limit)))
                    self.io.owner.pop(rid, None)
                    continue
            try:
                engine.add_request(rid, cmd.prompt_token_ids, params, priority=cmd.priority)
            except Exception as exc:  # noqa: BLE001 - a rejected request reports to its front-end
                out.rejected.append(rejection(rid, as_request_error(exc)))
                self.io.owner.pop(rid, None)
                continue
            if waiting is not None:
                waiting += n
            out.accepted.append(rid)
        return False

    # -- outputs ----------------------------------------------------------------------------

    def _add_output(self, outs: list[CoreOutputs], out: RequestOutput | EmbeddingRequestOutput) -> None:
        rid = out.request_id
        target = outs[self._owner(rid)]
        if isinstance(out, EmbeddingRequestOutput):
            target.embeddings.append(
                EmbeddingResult(rid, list(out.outputs.embedding), metrics_times(out.metrics))
            )
        else:
            target.deltas.append(self.deltas.delta(out))
        if out.finished:
            self.io.owner.pop(rid, None)

    def _flush(self, outs: list[CoreOutputs], *, log: bool) -> None:
        """Send each front-end its part; stats (and cache events, token intervals) go to every
        front-end, intervals to front-end 0 only (it records the latency histogram)."""
        engine = self.engine
        stats = engine.get_stats()
        intervals = engine.pop_token_intervals()
        added, removed = engine.kv_cache_manager.pool.take_events()
        steps = engine.step_events.since(self.last_step) if engine.task != "embed" else []
        if steps:
            self.last_step = steps[-1].step
        heartbeat = CoreOutputs(self.options.rank, time.monotonic(), stats=stats)
        self.io.stats_for_heartbeat = heartbeat
        for index, out in enumerate(outs):
            out.stats = stats
            out.cached_blocks = added
            out.evicted_blocks = removed
            out.steps = steps
            if index == 0:
                out.token_intervals = intervals
            if not (
                out.accepted
                or out.rejected
                or out.deltas
                or out.embeddings
                or added
                or removed
                or steps
                or out.state
            ):
                if index or not intervals:
                    continue  # the I/O thread's heartbeat carries the stats
            # Stamped as it is sent, not when the step began: the front-end maps the core's times
            # by (its receive time - core_time), and an earlier stamp would move the times this
            # step recorded past the message's receipt (a first token after the client got it).
            out.core_time = time.monotonic()
            self.io.send(index, self.codec.encode(out))
        if log and self.stat_logger is not None:
            self.stat_logger.maybe_log(stats)


def run_engine_core(config: EngineConfig, options: CoreOptions) -> None:
    """The body of a core process: load the engine, greet the front-ends, run the step loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the whole group: the front-end decides

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    logging.basicConfig(
        level=options.log_level.upper(),
        format=f"%(levelname)s %(asctime)s core{options.rank} %(name)s: %(message)s",
        force=True,
    )
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    io = _CoreIO(options, ctx)
    from pagedllm.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine.from_config(config)
    except BaseException as exc:  # noqa: BLE001 - reported to the front-end, then the process exits
        reason = f"{type(exc).__name__}: {exc}"
        logger.error("Core %d could not start: %s", options.rank, reason)
        io.fail_start(reason)
        io.dealers[0].close(linger=2000)
        ctx.term()
        sys.exit(1)
    status = 0
    try:
        io.greet(engine_info(engine), timeout=FRONTEND_TIMEOUT_S)
        # Set up on first use (xgrammar loads slowly; a model it cannot serve refuses the request).
        io.grammar_compile = lambda params: engine.structured_output_manager.compile(params)
        io.start()
        EngineCoreProc(engine, io, options).run()
    except SystemExit:
        pass
    except BaseException as exc:  # noqa: BLE001 - every front-end learns why the core stops
        logger.exception("Core %d failed; its requests end with an error.", options.rank)
        io.stopping.set()
        if io.thread is not None:
            io.thread.join(2.0)
        payload = Codec().encode(CoreDead(options.rank, f"{type(exc).__name__}: {exc}"))
        for sock in io.dealers:
            sock.send(payload)
        status = 1
    io.close()
    for sock in io.dealers:
        sock.close(linger=1000)
    io.outbox.close(0)
    io.sender.close(0)
    ctx.term()
    os._exit(status)  # skip interpreter teardown of the model's native state


def main(argv: list[str]) -> None:
    """``python -m pagedllm.engine.core_process SPEC``: SPEC is JSON ``{"config": EngineConfig,
    "options": CoreOptions}`` (as :func:`pagedllm.engine.core_launch.start_local_cores` writes it)."""
    from pagedllm.config import EngineConfig

    spec = msgspec.json.decode(argv[0])
    config = msgspec.convert(spec["config"], EngineConfig)
    options = msgspec.convert(spec["options"], CoreOptions)
    run_engine_core(config, options)


if __name__ == "__main__":
    main(sys.argv[1:])


__all__ = ["CoreOptions", "EngineCoreProc", "engine_info", "main", "run_engine_core"]
