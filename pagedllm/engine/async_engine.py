"""An asyncio front end to an engine served in this process, for the HTTP server.

:class:`AsyncLLMEngine` runs an :class:`~pagedllm.engine.engine_core.EngineCore` (the step loop,
admission, grammar compilation, aborts) on one background thread, the only thread that touches the
synchronous engine, and is the core's transport: commands go in through the core's in-process queue,
and the core's answers (accepted, rejected, a step's outputs) reach the callers' streams on their
event loops. Everything a caller sees is :class:`~pagedllm.engine.async_client.AsyncEngineClient`'s,
the same as over engine-core processes.

An engine whose task is ``embed`` is stepped with ``step_pooling``; its requests are submitted with
:meth:`AsyncLLMEngine.encode`, which returns the embedding. If the engine thread dies, every pending
and future request gets an :class:`EngineDeadError`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pagedllm.engine.async_client import AsyncEngineClient, RequestStream
from pagedllm.engine.engine_core import (
    AbortCommand,
    AddCommand,
    EngineCore,
    EngineOutput,
    StopCommand,
    SyncEngine,
    engine_info,
)
from pagedllm.engine.errors import EngineDeadError, QueueFullError, RequestAbortedError
from pagedllm.engine.observe.engine_state import EngineCall, EngineStateAccess
from pagedllm.engine.observe.metrics import EngineMetrics
from pagedllm.engine.observe.stats import EngineStats
from pagedllm.lora_request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

logger = logging.getLogger(__name__)


class AsyncLLMEngine(EngineStateAccess, AsyncEngineClient):
    """Serves a synchronous engine, stepped by an engine core on a background thread, to asyncio
    callers (``max_queued_requests``, ``grammar_compile_timeout``: the core's admission)."""

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
        super().__init__(metrics=metrics, on_death=on_death, max_queued_requests=max_queued_requests)
        self.engine = engine  # touched by the engine thread only
        self.info = engine_info(engine)
        self.tokenizer = engine.tokenizer
        self.core = EngineCore(
            engine,
            self,
            max_queued_requests=max_queued_requests,
            grammar_compile_timeout=grammar_compile_timeout,
            log_stats_interval=log_stats_interval,
        )
        self._thread: threading.Thread | None = None

    @property
    def grammar_compile_timeout(self) -> float:
        """Seconds a request's grammar may take to compile before the request is refused."""
        return self.core.grammar_compile_timeout

    @grammar_compile_timeout.setter
    def grammar_compile_timeout(self, seconds: float) -> None:
        self.core.grammar_compile_timeout = seconds

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
        self.core.submit(StopCommand())
        self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive and has not failed."""
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    def _run(self) -> None:
        try:
            self.core.run()
        except BaseException as exc:  # noqa: BLE001 - any failure must reach the waiting callers
            logger.exception("The engine loop failed; no further requests can be served.")
            self.failure = exc
            self._fail_everything(exc)
            if self.on_death is not None:
                self.on_death(exc)
            return
        self._fail_everything(None)

    # ------------------------------------------------------------------ to the core

    def _send_add(
        self,
        stream: RequestStream,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        priority: int,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.core.submit(
            AddCommand(stream.request_id, prompt, params, priority, stream.times.arrival, lora_request)
        )

    def _send_abort(self, request_ids: list[str]) -> None:
        self.core.submit(AbortCommand(request_ids))

    def _send(self, command: EngineCall) -> None:
        """A call for the engine thread to run between two steps (the dashboard's snapshot)."""
        self.core.submit(command)

    # ------------------------------------------------------------------ the core's transport

    def accepted(self, request_id: str) -> None:
        self._accept(request_id)

    def rejected(self, request_id: str, exc: BaseException) -> None:
        self._reject(request_id, exc)

    def outputs(self, outputs: Sequence[EngineOutput]) -> None:
        self._dispatch(outputs)

    def aborted(self, request_ids: list[str]) -> None:
        pass  # their streams were dropped when the caller aborted

    def iteration_done(self, stats: EngineStats, *, stepped: bool) -> None:
        self._latest_stats = stats
        if self.metrics is not None:
            if stepped:
                observe = self.metrics.inter_token_latency.observe
                for interval in self.engine.pop_token_intervals():
                    observe(interval)
            self.metrics.record_stats(stats)


__all__ = ["AsyncLLMEngine", "EngineDeadError", "EngineOutput", "QueueFullError", "RequestAbortedError"]
