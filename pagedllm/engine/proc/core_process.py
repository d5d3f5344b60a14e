"""The engine-core process: one :class:`~pagedllm.engine.llm_engine.LLMEngine` and its step loop,
served to front-end processes over ZeroMQ.

Two threads share the process:

* the **step loop** (the main thread) is an :class:`~pagedllm.engine.engine_core.EngineCore`, the
  same as an engine served in one process: it applies the commands the I/O thread submitted (add,
  abort, shutdown, a snapshot, a prefix-cache reset), runs a step when requests are unfinished,
  and through :class:`EngineCoreProc`, its transport, hands each front-end one
  :class:`~pagedllm.engine.proc.protocol.CoreOutputs` per iteration (acceptances, rejections with
  their typed errors, output deltas, stats) through an in-process socket;
* the **I/O thread** owns the sockets to the front-ends: it decodes incoming messages into
  commands, forwards the step loop's messages, and sends a heartbeat whenever the step loop has
  said nothing for :data:`HEARTBEAT_S` (a long forward included), so that front-ends can tell a
  busy core from a dead one.

Start-up: the core connects a DEALER socket to front-end 0, loads the model, and says
:class:`Hello`; front-end 0 answers with every front-end's address and the core connects to (and
greets) the others. A core whose model fails to load says :class:`StartFailed` and exits 1. A core
whose step raises says :class:`CoreDead` (naming the exception) to every front-end and exits 1. It
exits 0 on :class:`Shutdown`, on SIGTERM, when no front-end has been heard from for
:data:`FRONTEND_TIMEOUT_S`, or when the process that started it has exited.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
import zmq

from pagedllm.engine.engine_core import (
    AbortCommand,
    AddCommand,
    CoreCommand,
    EngineCore,
    StopCommand,
    engine_info,
)
from pagedllm.engine.errors import RequestError, as_request_error
from pagedllm.engine.observe.engine_state import EngineCall, encode_state
from pagedllm.engine.observe.stats import EngineStats
from pagedllm.engine.proc.launch import CoreOptions
from pagedllm.engine.proc.output_codec import encode_output, metrics_times
from pagedllm.engine.proc.protocol import (
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
from pagedllm.outputs import EmbeddingRequestOutput, RequestOutput
from pagedllm.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine

logger = logging.getLogger("pagedllm.sched")

# The I/O thread says something at least this often (seconds).
HEARTBEAT_S = 0.2
# A core with no word from any front-end for this long exits (its front-ends are gone).
FRONTEND_TIMEOUT_S = 30.0


class _CoreIO:
    """The I/O thread's state: sockets to the front-ends, and the step loop's core that it submits
    the front-ends' commands to."""

    def __init__(self, options: CoreOptions, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.options = options
        self.ctx = ctx
        self.codec = Codec()
        self.identity = f"core-{options.rank}".encode()
        self.dealers: list[zmq.Socket[bytes]] = [self._connect(options.frontend_address)]
        self.core: EngineCore | None = None  # the step loop, set before the I/O thread starts
        # request id -> the front-end (index) that sent it: set by the I/O thread as the request
        # arrives (before the step loop sees it), read and dropped by the step loop (each a single
        # dict operation).
        self.owner: dict[str, int] = {}
        # The step loop's outgoing messages: (front-end index or -1 for all, payload).
        self.outbox = ctx.socket(zmq.PAIR)
        self.outbox.bind(f"inproc://core-out-{id(self)}")
        self.sender = ctx.socket(zmq.PAIR)  # used by the step loop only
        self.sender.connect(f"inproc://core-out-{id(self)}")
        self.stats_for_heartbeat: CoreOutputs | None = None
        # Snapshots taken by the step loop, (front-end, query id, JSON), sent with its next outputs
        # (the step loop alone touches it).
        self.state_answers: list[tuple[int, int, bytes]] = []
        self.last_sent = 0.0
        self.last_heard = time.monotonic()
        self.parent_pid = os.getppid()
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

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
            ready = dict(poller.poll(int(HEARTBEAT_S * 500)))
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
                self._submit(StopCommand())
                return
            if now - self.last_heard > FRONTEND_TIMEOUT_S:
                logger.error(
                    "Core %d: no front-end heard from in %.0f s; exiting.",
                    self.options.rank,
                    FRONTEND_TIMEOUT_S,
                )
                self._submit(StopCommand())
                return

    def _submit(self, command: CoreCommand) -> None:
        assert self.core is not None, "the I/O thread runs once the step loop exists"
        self.core.submit(command)

    def _handle(self, index: int, message: object) -> None:
        if isinstance(message, AddRequest):
            self.owner[message.request_id] = index
            params = message.sampling if message.sampling is not None else message.pooling
            if message.sampling is not None and message.sampling.output_kind is RequestOutputKind.CUMULATIVE:
                # Outputs travel as deltas (the front-end adds them up for a caller that wants
                # cumulative outputs): the output processor makes them.
                message.sampling.output_kind = RequestOutputKind.DELTA
            self._submit(
                AddCommand(
                    message.request_id,
                    message.prompt_token_ids,
                    params,
                    message.priority,
                    lora_request=message.lora,
                )
            )
        elif isinstance(message, AbortRequests):
            self._submit(AbortCommand(message.request_ids))
        elif isinstance(message, Shutdown):
            self._submit(StopCommand())
        elif isinstance(message, ResetPrefixCache):
            self._submit(EngineCall(self._reset_prefix_cache))
        elif isinstance(message, EngineStateQuery):
            query_id = message.query_id
            self._submit(
                EngineCall(lambda engine: self.state_answers.append((index, query_id, encode_state(engine))))
            )
        elif isinstance(message, Ping | Welcome):
            pass

    def _reset_prefix_cache(self, engine: LLMEngine) -> None:
        if not engine.reset_prefix_cache():
            logger.warning(
                "Core %d: the prefix cache was not reset (requests hold blocks).", self.options.rank
            )

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


class EngineCoreProc:
    """The transport of a core process's step loop (see the module docstring): it gathers what one
    loop iteration has for each front-end and sends it when the iteration is done."""

    def __init__(self, engine: LLMEngine, io: _CoreIO, options: CoreOptions) -> None:
        self.engine = engine
        self.io = io
        self.options = options
        self.codec = Codec()
        self.num_frontends = len(io.dealers)
        pool = engine.kv_cache_manager.pool
        pool.report_events = options.report_cache_events
        self.last_step = 0  # the latest step record sent to the front-ends
        self.outs = self._new_outputs()

    def _new_outputs(self) -> list[CoreOutputs]:
        now = time.monotonic()
        return [CoreOutputs(self.options.rank, now) for _ in range(self.num_frontends)]

    def _owner(self, request_id: str) -> int:
        return self.io.owner.get(request_id, 0)

    # -- the core's answers ----------------------------------------------------------------------

    def accepted(self, request_id: str) -> None:
        self.outs[self._owner(request_id)].accepted.append(request_id)

    def rejected(self, request_id: str, exc: BaseException) -> None:
        self.outs[self._owner(request_id)].rejected.append(rejection(request_id, as_request_error(exc)))
        self.io.owner.pop(request_id, None)

    def aborted(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.io.owner.pop(rid, None)

    def outputs(self, outputs: Sequence[RequestOutput | EmbeddingRequestOutput]) -> None:
        for out in outputs:
            self._add_output(self.outs, out)

    def iteration_done(self, stats: EngineStats, *, stepped: bool) -> None:
        outs, self.outs = self.outs, self._new_outputs()
        while self.io.state_answers:
            index, query_id, state = self.io.state_answers.pop(0)
            outs[min(index, len(outs) - 1)].state = (query_id, state)
        self._flush(outs, stats)

    # -- outputs ----------------------------------------------------------------------------

    def _add_output(self, outs: list[CoreOutputs], out: RequestOutput | EmbeddingRequestOutput) -> None:
        rid = out.request_id
        target = outs[self._owner(rid)]
        if isinstance(out, EmbeddingRequestOutput):
            target.embeddings.append(
                EmbeddingResult(rid, list(out.outputs.embedding), metrics_times(out.metrics))
            )
        else:
            target.deltas.append(encode_output(out))
        if out.finished:
            self.io.owner.pop(rid, None)

    def _flush(self, outs: list[CoreOutputs], stats: EngineStats) -> None:
        """Send each front-end its part; stats (and cache events, token intervals) go to every
        front-end, intervals to front-end 0 only (it records the latency histogram)."""
        engine = self.engine
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
        io.core = EngineCore(
            engine,
            EngineCoreProc(engine, io, options),
            max_queued_requests=options.max_queued_requests,
            grammar_compile_timeout=options.grammar_compile_timeout,
            log_stats_interval=options.log_stats_interval,
            idle_wait=HEARTBEAT_S,
            should_stop=lambda: io.thread is not None and not io.thread.is_alive(),
        )
        io.start()
        io.core.run()
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
    """``python -m pagedllm.engine.proc.core_process SPEC``: SPEC is JSON ``{"config": EngineConfig,
    "options": CoreOptions}`` (as :func:`pagedllm.engine.proc.launch.start_local_cores` writes it)."""
    from pagedllm.config import EngineConfig

    spec = msgspec.json.decode(argv[0])
    config = msgspec.convert(spec["config"], EngineConfig)
    options = msgspec.convert(spec["options"], CoreOptions)
    run_engine_core(config, options)


if __name__ == "__main__":
    main(sys.argv[1:])


__all__ = ["EngineCoreProc", "engine_info", "main", "run_engine_core"]
