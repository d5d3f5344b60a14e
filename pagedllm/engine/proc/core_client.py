"""The front-end's end of the engine-core processes: start-up handshake, routing, output deltas
(handed on, or added up for callers that want cumulative outputs), and liveness.

A :class:`CoreClient` binds one ROUTER socket (front-end ``index`` of the server) that every core
connects to. After the handshake (each expected rank says :class:`Hello`; front-end 0 answers with
every front-end's address) one I/O thread owns the socket: it sends the commands queued by any
thread (:meth:`add`, :meth:`abort`), decodes what the cores send, and reports to a
:class:`ClientListener` from that thread.

A core counts as dead when it says so (:class:`CoreDead`), when its process (if this machine runs
it) has exited, when the launcher of its machine reports its exit (``--headless``), or when it has
been silent for ``liveness_timeout`` seconds (``--engine-liveness-timeout``; cores send a heartbeat
every 0.2 s, from a thread that a long forward does not block). A core silent that long is also
told to shut down and, when this machine runs it, killed (SIGKILL): a stopped or hung process never
comes back to requests that have already failed. Its requests then fail with
:class:`~pagedllm.engine.async_engine.EngineDeadError`; new requests go to the living cores; when
none is left the listener hears :meth:`ClientListener.all_dead`. Before that, a core silent for
:func:`~pagedllm.engine.proc.liveness.unresponsive_after` (2 s by default) is *unresponsive*
(:meth:`CoreClient.unresponsive`: ``/health`` says 503 while any is): new requests avoid it while
another core answers, and it is responsive again as soon as it is heard from.
"""

from __future__ import annotations

import copy
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import zmq

from pagedllm.engine.delta_outputs import OutputAccumulator
from pagedllm.engine.errors import EngineDeadError, RequestError
from pagedllm.engine.observe.stats import EngineStats
from pagedllm.engine.observe.step_events import StepRecord
from pagedllm.engine.proc.dp_router import PrefixRouter
from pagedllm.engine.proc.liveness import (
    DEFAULT_LIVENESS_TIMEOUT_S,
    describe_exit,
    kill_process,
    pid_state,
    unresponsive_after,
)
from pagedllm.engine.proc.output_codec import OutputDecoder, metrics_from_times
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
    rejection_error,
)
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("pagedllm.client")

# The client pings every core this often (so that cores notice a front-end that went away).
PING_S = 1.0


class ClientListener(Protocol):
    """What a :class:`CoreClient` reports; every call comes from its I/O thread."""

    def accepted(self, request_id: str) -> None: ...

    def rejected(self, request_id: str, exc: BaseException) -> None: ...

    def outputs(self, outputs: list[RequestOutput | EmbeddingRequestOutput]) -> None: ...

    def failed(self, request_ids: list[str], exc: BaseException) -> None: ...

    def core_lost(self, rank: int) -> None: ...  # a core died (after ``failed`` for its requests)

    def all_dead(self, exc: BaseException) -> None: ...

    def stats_reported(self, rank: int, stats: EngineStats, token_intervals: list[float]) -> None: ...

    def steps_reported(self, rank: int, steps: list[StepRecord]) -> None: ...  # the dashboard's step records

    def state_reported(self, rank: int, query_id: int, state: bytes | None) -> None: ...  # None: no answer


@dataclass
class _Core:
    rank: int
    identity: bytes
    pid: int | None  # a process of this machine, watched directly
    last_seen: float
    stats: EngineStats = field(default_factory=EngineStats)
    alive: bool = True
    in_flight: int = 0  # sequences this front-end has on it


@dataclass
class _Add:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams | PoolingParams
    priority: int = 0
    lora_request: LoRARequest | None = None


@dataclass
class _Abort:
    request_ids: list[str]


class _Reset:
    pass


@dataclass
class _StateQuery:
    rank: int
    query_id: int


class CoreClient:
    """One front-end's connection to the engine cores of ranks ``ranks``.

    ``pids`` maps the ranks whose processes run on this machine to their process ids (watched
    directly, so a killed core is noticed at once). ``routing`` is ``prefix`` or ``round_robin``.
    ``liveness_timeout``: seconds of silence after which a core is taken for dead.
    """

    def __init__(
        self,
        *,
        index: int,
        frontend_addresses: list[str],
        ranks: Sequence[int],
        listener: ClientListener | None = None,
        pids: dict[int, int] | None = None,
        pid_exit: Callable[[int], int | None] | None = None,
        routing: str = "prefix",
        owns_cores: bool = True,
        liveness_timeout: float = DEFAULT_LIVENESS_TIMEOUT_S,
    ) -> None:
        self.index = index
        self.liveness_timeout = liveness_timeout
        self.frontend_addresses = list(frontend_addresses)
        self.ranks = list(ranks)
        # Set before start(); the handshake reports nothing.
        self.listener: ClientListener = listener  # type: ignore[assignment]
        self.pids = dict(pids or {})
        # The exit status of a rank's process when this process started it (None while it runs).
        self.pid_exit = pid_exit
        self.routing = routing
        # Whether close() tells the cores to shut down (False when a launcher stops them after every
        # front-end has stopped).
        self.owns_cores = owns_cores
        self._closing = False
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.bind(self.frontend_addresses[index])
        self.codec = Codec()
        self.info: EngineInfo | None = None
        self.cores: dict[int, _Core] = {}
        self.router: PrefixRouter | None = None
        self._commands: queue.SimpleQueue[_Add | _Abort | _Reset | _StateQuery | None] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        # I/O-thread state: request id -> rank, and what makes its outputs from the core's messages.
        self._owner: dict[str, tuple[int, int]] = {}
        self._acc: dict[str, OutputDecoder] = {}
        self._offsets: dict[int, float] = {}
        self.dead_reason: str | None = None

    # ------------------------------------------------------------------ start-up

    def wait_for_cores(self, timeout: float, should_stop: Callable[[], bool] | None = None) -> EngineInfo:
        """Wait until every rank has said Hello (answering each with the front-ends' addresses);
        raises RuntimeError naming the problem when a core fails to start, exits, or is too slow.
        ``should_stop()`` True abandons the wait (RuntimeError)."""
        deadline = time.monotonic() + timeout
        decode = self.codec.from_core.decode
        ping = self.codec.encode(Ping())
        last_ping = time.monotonic()
        while len(self.cores) < len(self.ranks):
            if time.monotonic() - last_ping >= PING_S:  # the cores that joined wait for the others
                last_ping = time.monotonic()
                for core in self.cores.values():
                    self._send(core, ping)
            if self.sock.poll(100):
                identity, payload = self.sock.recv_multipart()
                message = decode(payload)
                if isinstance(message, StartFailed):
                    raise RuntimeError(f"engine core {message.rank} could not start: {message.reason}")
                if isinstance(message, Hello):
                    self._hello(identity, message)
                continue
            for rank in self.ranks:
                if rank in self.cores:
                    continue
                state = self._process_state(rank)
                if state is not None:
                    raise RuntimeError(f"engine core {rank} {state} during start-up")
            if should_stop is not None and should_stop():
                raise RuntimeError("interrupted while waiting for the engine cores")
            if time.monotonic() > deadline:
                missing = sorted(set(self.ranks) - set(self.cores))
                raise RuntimeError(f"engine cores {missing} did not start within {timeout:g} s")
        assert self.info is not None
        self.router = PrefixRouter(self.ranks, self.info.block_size, self.routing)
        return self.info

    def _hello(self, identity: bytes, hello: Hello) -> None:
        if hello.rank not in self.ranks:
            logger.warning("Ignoring a core of unexpected rank %d.", hello.rank)
            return
        if self.info is None:
            self.info = hello.info
        elif hello.info != self.info:
            raise RuntimeError(
                f"engine core {hello.rank} runs a different engine ({hello.info.model_name}, "
                f"max_model_len {hello.info.max_model_len}) than core {self.ranks[0]}"
            )
        if self.index == 0:
            self.sock.send_multipart([identity, self.codec.encode(Welcome(self.frontend_addresses))])
        self.cores[hello.rank] = _Core(hello.rank, identity, self.pids.get(hello.rank), time.monotonic())
        logger.info("Engine core %d joined (%d of %d).", hello.rank, len(self.cores), len(self.ranks))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pagedllm-core-client", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Send a request to a core; the listener hears ``accepted`` or ``rejected`` for it (the
        caller has checked ``priority`` with :func:`~pagedllm.engine.engine_checks.check_priority`;
        a value no message can carry is refused as the request cannot be sent)."""
        self._put(_Add(request_id, prompt, prompt_ids, params, priority, lora_request))

    def abort(self, request_ids: list[str]) -> None:
        self._put(_Abort(request_ids))

    def reset_prefix_cache(self) -> None:
        """Ask every core to forget its cached blocks (after the requests sent before)."""
        self._put(_Reset())

    def query_state(self, rank: int, query_id: int) -> None:
        """Ask core ``rank`` for its snapshot; the listener hears ``state_reported`` with ``query_id``
        (its state, or None when the core is not alive)."""
        self._put(_StateQuery(rank, query_id))

    def _put(self, command: _Add | _Abort | _Reset | _StateQuery | None) -> None:
        self._commands.put(command)
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # closed
            pass

    @property
    def num_alive(self) -> int:
        return sum(1 for c in self.cores.values() if c.alive)

    def unresponsive(self, now: float | None = None) -> dict[int, float]:
        """The living cores silent for over :func:`unresponsive_after` the liveness timeout (2 s by
        default): rank -> seconds since last heard from. Safe from any thread."""
        now = time.monotonic() if now is None else now
        after = unresponsive_after(self.liveness_timeout)
        silent = {c.rank: now - c.last_seen for c in list(self.cores.values()) if c.alive}
        return {rank: s for rank, s in silent.items() if s > after}

    def close(self, timeout: float = 5.0) -> None:
        """Stop the I/O thread (telling every core to shut down, if this client owns them);
        idempotent. Cores that exit from then on are not reported as deaths."""
        if self._closing:
            return
        self._closing = True
        if self._thread is not None and self._thread.is_alive():
            self._put(None)
            self._thread.join(timeout)
        elif self.owns_cores:
            self._shutdown_cores()
        self.sock.close(linger=1000)
        self.ctx.term()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _shutdown_cores(self) -> None:
        payload = self.codec.encode(Shutdown())
        for core in self.cores.values():
            if core.alive:
                self._send(core, payload)

    # ------------------------------------------------------------------ the I/O thread

    def _send(self, core: _Core, payload: bytes) -> bool:
        try:
            self.sock.send_multipart([core.identity, payload], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:  # unreachable (disconnected) or its queue is full
            logger.warning("Could not send to engine core %d: %s", core.rank, exc)
            return False

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        decode = self.codec.from_core.decode
        last_ping = time.monotonic()
        ping = self.codec.encode(Ping())
        try:
            while True:
                poller.poll(100)
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
                if not self._drain_commands():
                    if self.owns_cores:
                        self._shutdown_cores()
                    return
                while self.sock.poll(0):
                    identity, payload = self.sock.recv_multipart()
                    try:
                        message = decode(payload)
                    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                        logger.error("Dropped a message from an engine core that does not decode: %s", exc)
                        continue
                    self._handle(message)
                now = time.monotonic()
                if now - last_ping >= PING_S:
                    last_ping = now
                    for core in self.cores.values():
                        if core.alive:
                            self._send(core, ping)
                self._check_liveness(now)
        except BaseException as exc:  # noqa: BLE001 - the front-end must hear that it is cut off
            logger.exception("The engine-core client failed.")
            self._all_dead(f"the front-end's engine client failed: {exc!r}")

    def _drain_commands(self) -> bool:
        """Send queued commands; False when asked to stop."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True
            if cmd is None:
                return False
            if isinstance(cmd, _Reset):
                payload = self.codec.encode(ResetPrefixCache())
                for core in self.cores.values():
                    if core.alive:
                        self._send(core, payload)
                if self.router is not None:
                    for rank in list(self.router.index):
                        self.router.index[rank].clear()
                continue
            if isinstance(cmd, _StateQuery):
                target = self.cores.get(cmd.rank)
                payload = self.codec.encode(EngineStateQuery(cmd.query_id))
                if target is None or not target.alive or not self._send(target, payload):
                    self.listener.state_reported(cmd.rank, cmd.query_id, None)
                continue
            if isinstance(cmd, _Abort):
                by_rank: dict[int, list[str]] = {}
                for rid in cmd.request_ids:
                    owner = self._owner.pop(rid, None)
                    self._acc.pop(rid, None)
                    if owner is not None:
                        rank, n = owner
                        self.cores[rank].in_flight -= n
                        by_rank.setdefault(rank, []).append(rid)
                for rank, ids in by_rank.items():
                    core = self.cores[rank]
                    if core.alive:
                        self._send(core, self.codec.encode(AbortRequests(ids)))
                continue
            self._route(cmd)

    def _route(self, cmd: _Add) -> None:
        # An unresponsive core gets new requests only when no core answers.
        silent = self.unresponsive()
        loads = {
            c.rank: max(c.in_flight, c.stats.num_running + c.stats.num_waiting)
            for c in self.cores.values()
            if c.alive and (c.rank not in silent or len(silent) == self.num_alive)
        }
        if not loads:
            self.listener.rejected(cmd.request_id, EngineDeadError(self.dead_message()))
            return
        assert self.router is not None
        lora_int_id = cmd.lora_request.lora_int_id if cmd.lora_request is not None else 0
        rank = self.router.choose(cmd.prompt_ids, loads, lora_int_id)
        core = self.cores[rank]
        params = cmd.params
        if isinstance(params, SamplingParams):
            cumulative = params.output_kind is RequestOutputKind.CUMULATIVE
            if cumulative:  # the core sends deltas; they are added up here
                params = copy.copy(params)
                params.output_kind = RequestOutputKind.DELTA
            message = AddRequest(cmd.request_id, cmd.prompt_ids, sampling=params, priority=cmd.priority)
            n = params.n
            self._acc[cmd.request_id] = OutputDecoder(
                cmd.prompt, cmd.prompt_ids, OutputAccumulator(n) if cumulative else None
            )
        else:
            message = AddRequest(cmd.request_id, cmd.prompt_ids, pooling=params, priority=cmd.priority)
            n = 1
        message.lora = cmd.lora_request  # the adapter it runs with (a pooling core refuses one)
        try:
            payload = self.codec.encode(message)
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
            self._acc.pop(cmd.request_id, None)  # a value no message can carry: this request alone fails
            self.listener.rejected(
                cmd.request_id, RequestError(None, f"The request cannot be sent to the engine: {exc}")
            )
            return
        if not self._send(core, payload):
            self._acc.pop(cmd.request_id, None)
            self.listener.rejected(cmd.request_id, EngineDeadError(f"engine core {rank} is unreachable"))
            return
        self._owner[cmd.request_id] = (rank, n)
        core.in_flight += n
        self.router.routed(rank, cmd.prompt_ids, lora_int_id)

    def _finish(self, request_id: str) -> None:
        owner = self._owner.pop(request_id, None)
        self._acc.pop(request_id, None)
        if owner is not None:
            rank, n = owner
            self.cores[rank].in_flight -= n

    def _handle(self, message: object) -> None:
        if isinstance(message, CoreOutputs):
            core = self.cores.get(message.rank)
            if core is None or not core.alive:
                return
            now = time.monotonic()
            core.last_seen = now
            offset = now - message.core_time
            listener = self.listener
            for rid in message.accepted:
                listener.accepted(rid)
            for rej in message.rejected:
                self._finish(rej.request_id)
                listener.rejected(rej.request_id, rejection_error(rej))
            outputs: list[RequestOutput | EmbeddingRequestOutput] = []
            for delta in message.deltas:
                acc = self._acc.get(delta.request_id)
                if acc is None:
                    continue  # aborted meanwhile
                outputs.append(acc.output(delta, offset))
                if delta.finished:
                    self._finish(delta.request_id)
            for emb in message.embeddings:
                if self._owner.get(emb.request_id) is None:
                    continue
                outputs.append(self._embedding(emb, offset))
                self._finish(emb.request_id)
            if outputs:
                listener.outputs(outputs)
            if self.router is not None:
                if message.evicted_blocks:
                    self.router.remove(message.rank, message.evicted_blocks)
                if message.cached_blocks:
                    self.router.add(message.rank, message.cached_blocks)
            if message.steps:
                listener.steps_reported(message.rank, message.steps)
            if message.state is not None:
                listener.state_reported(message.rank, *message.state)
            if message.stats is not None:
                core.stats = message.stats
                listener.stats_reported(message.rank, message.stats, message.token_intervals)
        elif isinstance(message, CoreDead) and not self._closing:
            self._core_died(message.rank, message.reason)
        elif isinstance(message, Hello | StartFailed):
            logger.warning("Ignoring a late %s from core %d.", type(message).__name__, message.rank)

    def _embedding(self, emb: EmbeddingResult, offset: float) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput(
            request_id=emb.request_id,
            prompt=None,
            prompt_token_ids=[],
            outputs=EmbeddingOutput(emb.embedding),
            metrics=metrics_from_times(emb.times, offset),
        )

    def _check_liveness(self, now: float) -> None:
        if self._closing:
            return
        for core in list(self.cores.values()):
            if not core.alive:
                continue
            state = self._process_state(core.rank)
            if state is not None:
                self._core_died(core.rank, f"its process {state}")
                continue
            silence = now - core.last_seen
            if silence > self.liveness_timeout:
                self._stop_silent(core)
                self._core_died(
                    core.rank,
                    f"no word from it for {silence:.1f} s (--engine-liveness-timeout {self.liveness_timeout:g})",
                )

    def _stop_silent(self, core: _Core) -> None:
        """Tell a core taken for dead by its silence to shut down (should it ever read it) and kill
        its process if this machine runs it (it was just seen running, so the pid is still its)."""
        self._send(core, self.codec.encode(Shutdown()))
        if core.pid is not None:
            logger.error("Killing engine core %d (pid %d): silent for too long.", core.rank, core.pid)
            kill_process(core.pid)

    def _process_state(self, rank: int) -> str | None:
        """How a local core's process ended ("was killed by SIGKILL"), None while it runs or when
        this machine does not run it."""
        if self.pid_exit is not None:
            code = self.pid_exit(rank)
            if code is not None:
                return describe_exit(code)
        pid = self.pids.get(rank)
        if pid is not None and self.pid_exit is None:
            state = pid_state(pid)
            if state is None or state in "ZX":
                return f"(pid {pid}) has exited"
        return None

    def _core_died(self, rank: int, reason: str) -> None:
        core = self.cores.get(rank)
        if core is None or not core.alive:
            return
        core.alive = False
        core.in_flight = 0
        message = f"engine core {rank} died: {reason}"
        logger.error("%s", message)
        ids = [rid for rid, (r, _) in self._owner.items() if r == rank]
        for rid in ids:
            self._owner.pop(rid, None)
            self._acc.pop(rid, None)
        if self.router is not None:
            self.router.forget(rank)
        if ids:
            self.listener.failed(ids, EngineDeadError(message))
        self.listener.core_lost(rank)
        if not any(c.alive for c in self.cores.values()):
            self._all_dead(message)

    def _all_dead(self, message: str) -> None:
        self.dead_reason = message
        for core in self.cores.values():
            core.alive = False
        self.listener.all_dead(EngineDeadError(message))

    def dead_message(self) -> str:
        if self.dead_reason is None:
            return "The engine is not running."
        return f"The engine has stopped: {self.dead_reason}"


__all__ = [
    "DEFAULT_LIVENESS_TIMEOUT_S",
    "ClientListener",
    "CoreClient",
    "describe_exit",
    "pid_state",
]
