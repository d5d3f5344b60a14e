"""The engine core: one engine's step loop and the way of a request into it, written once.

An :class:`EngineCore` owns a synchronous engine (:class:`~pagedllm.engine.llm_engine.LLMEngine`, or
anything with its request and step methods) and is the only one that touches it, from the thread that
calls :meth:`EngineCore.run`. Other threads hand it commands with :meth:`EngineCore.submit`; what
comes out goes to a :class:`CoreTransport`, the only part that differs between an engine served in
this process (:class:`~pagedllm.engine.async_engine.AsyncLLMEngine`: a thread and the caller's event
loops) and one served to other processes (:mod:`pagedllm.engine.proc.core_process`: sockets).

The way in, for an :class:`AddCommand`:

1. A request with a structured-output grammar is compiled on a worker thread first (the engine's
   grammar cache keeps it), so a slow grammar stalls no step; one that fails is refused with its
   :class:`~pagedllm.errors.RequestError`, one that takes longer than ``grammar_compile_timeout``
   with :func:`~pagedllm.engine.errors.grammar_timeout_error`. An abort meanwhile drops it.
2. Between two steps, in the order the commands came: the waiting-queue bound
   (``max_queued_requests`` sequences; a request with ``n`` sequences counts ``n``) refuses with
   :class:`~pagedllm.errors.QueueFullError`; the engine's own checks (parameters, limits, length,
   request id, priority) refuse with their ``RequestError``; else the request is accepted.

Every request is answered exactly once, ``accepted`` or ``rejected``, on the step thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pagedllm.engine.engine_info import EngineInfo
from pagedllm.engine.errors import grammar_timeout_error, queue_full_error
from pagedllm.engine.observe.engine_state import EngineCall
from pagedllm.engine.observe.metrics import StatLogger
from pagedllm.engine.observe.stats import EngineStats
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import EmbeddingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# What a step hands to a request's caller: a generation snapshot, or an embedding (task "embed").
EngineOutput = RequestOutput | EmbeddingRequestOutput


class SyncEngine(Protocol):
    """What an engine core needs from the synchronous engine."""

    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams | None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def step_pooling(self) -> list[EmbeddingRequestOutput]: ...  # engines whose task is "embed"

    def abort_request(self, request_id: str | Iterable[str]) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def get_stats(self) -> EngineStats: ...

    def pop_token_intervals(self) -> list[float]: ...


class CoreTransport(Protocol):
    """Where an engine core's answers go; every call comes from the step thread."""

    def accepted(self, request_id: str) -> None: ...

    def rejected(self, request_id: str, exc: BaseException) -> None: ...  # a RequestError, mostly

    def outputs(self, outputs: Sequence[EngineOutput]) -> None: ...  # one step's

    def aborted(self, request_ids: list[str]) -> None: ...  # after the engine dropped them

    def iteration_done(self, stats: EngineStats, *, stepped: bool) -> None: ...  # after every pass


@dataclass
class AddCommand:
    """A request for the engine. ``arrival``: its arrival time on this process's monotonic clock
    (None: when the engine takes it)."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams | PoolingParams | None  # None: the engine's defaults
    priority: int = 0
    arrival: float | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)

    @property
    def num_sequences(self) -> int:
        """What it adds to the waiting queue: ``n`` sequences for a generate request, else one."""
        return self.params.n if isinstance(self.params, SamplingParams) else 1


@dataclass
class AbortCommand:
    request_ids: list[str]


class StopCommand:
    """Leave the step loop (after the commands before it)."""


@dataclass
class _Compiled:
    """A request whose grammar compilation ended (``future`` holds how)."""

    command: AddCommand
    future: concurrent.futures.Future[object] = field(repr=False)


CoreCommand = AddCommand | AbortCommand | StopCommand | EngineCall


def engine_info(engine: Any) -> EngineInfo:
    """What a front-end knows of ``engine`` (see :class:`EngineInfo`). An engine that states only its
    model and sizes (no ``config``: a scripted stand-in) reads as a generating one without limits."""
    config = getattr(engine, "config", None)
    if config is None:
        return EngineInfo(
            model_name=str(engine.model_name),
            task=str(getattr(engine, "task", "generate")),
            max_model_len=int(engine.max_model_len),
            vocab_size=int(engine.vocab_size),
            eos_token_ids=list(getattr(engine, "eos_token_ids", [])),
            default_sampling=dict(getattr(engine, "default_sampling", None) or {}),
            block_size=0,
            num_kv_blocks=0,
            max_num_seqs=0,
            max_logprobs=0,
            enable_prefix_caching=False,
        )
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


class EngineCore:
    """The step loop of one engine (see the module docstring).

    ``idle_wait``: how long the loop waits for a command while the engine has nothing to do (None:
    until one comes); ``should_stop()`` is asked after every pass (True leaves the loop).
    ``log_stats_interval``: seconds between throughput log lines (None: none).
    """

    def __init__(
        self,
        engine: SyncEngine,
        transport: CoreTransport,
        *,
        max_queued_requests: int | None = None,
        grammar_compile_timeout: float = 10.0,
        log_stats_interval: float | None = None,
        idle_wait: float | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        if max_queued_requests is not None and max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be non-negative, got {max_queued_requests}.")
        self.engine = engine
        self.transport = transport
        self.max_queued_requests = max_queued_requests
        self.grammar_compile_timeout = grammar_compile_timeout
        self.idle_wait = idle_wait
        self.should_stop = should_stop
        self.stat_logger = StatLogger(log_stats_interval) if log_stats_interval else None
        self.commands: queue.SimpleQueue[CoreCommand | _Compiled] = queue.SimpleQueue()
        # Grammars in compilation: request id -> (deadline, command). The step thread alone changes it.
        self._compiling: dict[str, tuple[float, AddCommand]] = {}
        self._compiler: concurrent.futures.ThreadPoolExecutor | None = None
        self._step = engine.step_pooling if getattr(engine, "task", "generate") == "embed" else engine.step

    # ------------------------------------------------------------------ any thread

    def submit(self, command: CoreCommand) -> None:
        """Hand a command to the step loop (commands are applied in the order they are submitted)."""
        self.commands.put(command)

    # ------------------------------------------------------------------ the step thread

    def run(self) -> None:
        """Apply commands and step until a :class:`StopCommand` (or ``should_stop()``). An exception
        of the engine propagates: the caller reports it to the requests in flight."""
        engine = self.engine
        idle = True
        try:
            while True:
                commands = self._next_commands(block=not engine.has_unfinished_requests())
                if self._apply(commands):
                    return
                stepped = engine.has_unfinished_requests()
                if stepped:
                    if idle and self.stat_logger is not None:
                        self.stat_logger.reset(engine.get_stats())
                    self.transport.outputs(self._step())
                idle = not stepped
                stats = engine.get_stats()
                self.transport.iteration_done(stats, stepped=stepped)
                if stepped and self.stat_logger is not None:
                    self.stat_logger.maybe_log(stats)
                if self.should_stop is not None and self.should_stop():
                    return
        finally:
            if self._compiler is not None:
                self._compiler.shutdown(wait=False, cancel_futures=True)

    def _next_commands(self, *, block: bool) -> list[CoreCommand | _Compiled]:
        commands: list[CoreCommand | _Compiled] = []
        if block:
            wait = self.idle_wait
            if self._compiling:  # wake for the first compilation to time out
                first = min(deadline for deadline, _ in self._compiling.values())
                left = max(0.0, first - time.monotonic())
                wait = left if wait is None else min(wait, left)
            try:
                commands.append(self.commands.get(timeout=wait))
            except queue.Empty:
                pass
        while True:
            try:
                commands.append(self.commands.get_nowait())
            except queue.Empty:
                break
        self._expire_compilations()
        return commands

    def _apply(self, commands: list[CoreCommand | _Compiled]) -> bool:
        """Apply commands in order; True when asked to stop."""
        waiting: list[int] = []  # the waiting queue's length, read once when first needed
        for cmd in commands:
            if isinstance(cmd, StopCommand):
                return True
            if isinstance(cmd, AbortCommand):
                for rid in cmd.request_ids:
                    self._compiling.pop(rid, None)
                self.engine.abort_request(cmd.request_ids)
                self.transport.aborted(cmd.request_ids)
            elif isinstance(cmd, EngineCall):
                cmd.apply(self.engine)
            elif isinstance(cmd, _Compiled):
                entry = self._compiling.get(cmd.command.request_id)
                if entry is None or entry[1] is not cmd.command:
                    continue  # aborted, or refused for its time, meanwhile
                del self._compiling[cmd.command.request_id]
                exc = cmd.future.exception()
                if exc is not None:
                    self.transport.rejected(cmd.command.request_id, exc)
                else:
                    self._admit(cmd.command, waiting)
            elif not self._compile(cmd):
                self._admit(cmd, waiting)
        return False

    def _compile(self, cmd: AddCommand) -> bool:
        """Start compiling the request's grammar off this thread; False when it has none (or the
        engine compiles none)."""
        params = cmd.params
        if not isinstance(params, SamplingParams) or params.structured_outputs is None:
            return False
        if not hasattr(type(self.engine), "structured_output_manager"):
            return False  # an engine without grammars of its own: it checks the request itself
        if self._compiler is None:
            self._compiler = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="pagedllm-grammar")
        future = self._compiler.submit(self._compile_grammar, params.structured_outputs)
        self._compiling[cmd.request_id] = (time.monotonic() + self.grammar_compile_timeout, cmd)
        future.add_done_callback(lambda f: self.commands.put(_Compiled(cmd, f)))
        return True

    def _compile_grammar(self, params: StructuredOutputsParams) -> object:
        """On a worker thread: compile into the engine's grammar cache (the manager is set up on
        first use, as xgrammar loads slowly; a model it cannot serve refuses the request)."""
        manager: Any = getattr(self.engine, "structured_output_manager")  # noqa: B009 - a property
        return manager.compile(params)

    def _expire_compilations(self) -> None:
        """Refuse the requests whose grammar has compiled for longer than the timeout (the compilation
        cannot be interrupted: it finishes in its thread, into the cache)."""
        if not self._compiling:
            return
        now = time.monotonic()
        for rid, (deadline, _) in list(self._compiling.items()):
            if now > deadline:
                del self._compiling[rid]
                self.transport.rejected(rid, grammar_timeout_error(self.grammar_compile_timeout))

    def _admit(self, cmd: AddCommand, waiting: list[int]) -> None:
        """Queue a request in the engine, or refuse it (a full waiting queue, the engine's checks)."""
        limit = self.max_queued_requests
        adds = cmd.num_sequences
        if limit is not None:
            if not waiting:
                waiting.append(self.engine.get_stats().num_waiting)
            if waiting[0] + adds > limit:
                self.transport.rejected(cmd.request_id, queue_full_error(waiting[0], adds, limit))
                return
        try:
            self.engine.add_request(
                cmd.request_id,
                cmd.prompt,
                cmd.params,
                cmd.arrival,
                priority=cmd.priority,
                lora_request=cmd.lora_request,
            )
        except Exception as exc:  # noqa: BLE001 - a refused request reports to its caller
            self.transport.rejected(cmd.request_id, exc)
            return
        if waiting:
            waiting[0] += adds
        self.transport.accepted(cmd.request_id)


__all__ = [
    "AbortCommand",
    "AddCommand",
    "CoreCommand",
    "CoreTransport",
    "EngineCore",
    "EngineOutput",
    "StopCommand",
    "SyncEngine",
    "engine_info",
]
