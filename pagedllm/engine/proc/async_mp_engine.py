"""The asyncio front end over engine cores in other processes (the server's default).

:class:`AsyncMPEngine` is the multi-process transport of
:class:`~pagedllm.engine.async_client.AsyncEngineClient` (``add_request``, ``encode``,
``beam_search``, ``abort``, ``abort_all``, stats and liveness, with the same per-request streams as
an engine in this process): a :class:`~pagedllm.engine.proc.core_client.CoreClient` routes each request
to a core (data parallel: one router for every core) and its I/O thread delivers the accepted,
rejected and output events.
What the front-end knows of the engine is the :class:`~pagedllm.engine.proc.protocol.EngineInfo`
the cores reported, and its own tokenizer.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable
from typing import Any

from pagedllm.engine.async_client import AsyncEngineClient, RequestStream
from pagedllm.engine.engine_info import EngineInfo
from pagedllm.engine.errors import EngineDeadError
from pagedllm.engine.input_processor import tokenize_prompt
from pagedllm.engine.observe.engine_state import STATE_TIMEOUT_S
from pagedllm.engine.observe.metrics import EngineMetrics
from pagedllm.engine.observe.stats import EngineStats
from pagedllm.engine.observe.step_events import StepRecord, StepRing
from pagedllm.engine.proc.core_client import CoreClient
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import EmbeddingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class AsyncMPEngine(AsyncEngineClient):
    """Async requests served by engine-core processes through ``client`` (which this engine starts,
    listens to and closes). ``on_death`` is called once every core has died."""

    def __init__(
        self,
        client: CoreClient,
        info: EngineInfo,
        tokenizer: Any,
        *,
        metrics: EngineMetrics | None = None,
        on_death: Callable[[BaseException], None] | None = None,
        on_stop: Callable[[], None] | None = None,
        records_engine_stats: bool = True,
        max_queued_requests: int | None = None,
    ) -> None:
        # max_queued_requests is enforced by each core; known here for the front-end's own checks.
        super().__init__(metrics=metrics, on_death=on_death, max_queued_requests=max_queued_requests)
        self.info = info
        self.tokenizer = tokenizer
        self.client = client
        client.listener = self
        # Called after the client closed (the owner stops the core processes it started).
        self.on_stop = on_stop
        self._core_stats: dict[int, EngineStats] = {}
        self._shut_down = False
        # The dashboard's data: each core's step records (bounded rings, filled by the client's
        # thread from the cores' outputs), and the snapshots asked for and not yet answered.
        self._step_rings: dict[int, StepRing] = {}
        self._state_queries: dict[int, asyncio.Future[bytes | None]] = {}
        self._query_ids = itertools.count(1)
        self._query_lock = threading.Lock()
        # With several front-ends sharing metrics files, front-end 0 alone sets the engines' series.
        if not records_engine_stats:
            metrics = None
        self.engine_metrics = metrics
        if metrics is not None:
            metrics.register_engines([str(rank) for rank in client.ranks])
            metrics.set_engines_alive(len(client.cores))

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._started:
            return
        self.client.start()
        self._started = True

    def shutdown(self, timeout: float = 10.0) -> None:
        """Tell the cores to stop and close the client; requests in flight fail with EngineDeadError."""
        if not self._started or self._shut_down:
            return
        self._shut_down = True
        self.client.close(timeout)
        self._fail_everything(None)
        if self.on_stop is not None:
            self.on_stop()
            self.on_stop = None

    @property
    def is_running(self) -> bool:
        return self._started and self._dead is None and self.client.num_alive > 0

    def unresponsive_message(self) -> str | None:
        """What ``/health`` says while a living core has missed its heartbeats (None when every
        core answers): it is back to healthy as soon as the core is heard from, and taken for dead
        after the liveness timeout."""
        silent = self.client.unresponsive()
        if not silent:
            return None
        cores = ", ".join(
            f"engine core {rank} unresponsive for {s:.1f} s" for rank, s in sorted(silent.items())
        )
        return (
            f"{cores[0].upper()}{cores[1:]}; a core silent for {self.client.liveness_timeout:g} s is "
            "taken for dead and its requests fail (--engine-liveness-timeout)."
        )

    def dead_message(self) -> str:
        # The client records why its cores died before the caller side hears of it: prefer it.
        return self.client.dead_message() if self.client.dead_reason else super().dead_message()

    # ------------------------------------------------------------------ caller side

    def _send_add(
        self,
        stream: RequestStream,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        priority: int,
        lora_request: LoRARequest | None = None,
    ) -> None:
        try:
            text, ids = tokenize_prompt(self.tokenizer, prompt, self.info.vocab_size)
            self.client.add(stream.request_id, text, ids, params, priority, lora_request)
        except ValueError as exc:
            del self._streams[stream.request_id]  # the caller holds _lock
            stream.fail(exc)

    def _send_abort(self, request_ids: list[str]) -> None:
        self.client.abort(request_ids)

    # ------------------------------------------------------------------ the dashboard's data

    @property
    def engine_ranks(self) -> list[int]:
        return sorted(rank for rank, core in self.client.cores.items() if core.alive)

    async def engine_state(self, rank: int = 0) -> bytes:
        """Core ``rank``'s snapshot, taken by its step loop between two steps."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bytes | None] = loop.create_future()
        with self._query_lock:
            query_id = next(self._query_ids)
            self._state_queries[query_id] = future
        try:
            self.client.query_state(rank, query_id)
            state = await asyncio.wait_for(future, STATE_TIMEOUT_S)
        finally:
            with self._query_lock:
                self._state_queries.pop(query_id, None)
        if state is None:
            raise RuntimeError(f"Engine core {rank} is not running.")
        return state

    def step_records(self, since: int, limit: int | None = None, rank: int = 0) -> list[StepRecord]:
        ring = self._step_rings.get(rank)
        return ring.since(since, limit) if ring is not None else []

    # ------------------------------------------------------------------ the client's listener

    def steps_reported(self, rank: int, steps: list[StepRecord]) -> None:
        ring = self._step_rings.get(rank)
        if ring is None:
            ring = self._step_rings[rank] = StepRing()
        ring.extend(steps)

    def state_reported(self, rank: int, query_id: int, state: bytes | None) -> None:
        with self._query_lock:
            future = self._state_queries.get(query_id)
        if future is None:
            return  # given up on

        def answer() -> None:
            if not future.done():
                future.set_result(state)

        try:
            future.get_loop().call_soon_threadsafe(answer)
        except RuntimeError:  # the loop is closed
            pass

    def accepted(self, request_id: str) -> None:
        self._accept(request_id)

    def rejected(self, request_id: str, exc: BaseException) -> None:
        self._reject(request_id, exc)

    def outputs(self, outputs: list[RequestOutput | EmbeddingRequestOutput]) -> None:
        self._dispatch(outputs)

    def failed(self, request_ids: list[str], exc: BaseException) -> None:
        with self._lock:
            streams = [s for rid in request_ids if (s := self._streams.pop(rid, None)) is not None]
        for stream in streams:
            stream.fail(exc)

    def core_lost(self, rank: int) -> None:
        """A dead core holds nothing: its series read idle, the totals leave it out."""
        self._core_stats.pop(rank, None)
        self._latest_stats = total_stats(self._core_stats.values())
        if self.engine_metrics is not None:
            self.engine_metrics.clear_engine(str(rank))
            self.engine_metrics.set_engines_alive(self.client.num_alive)

    def all_dead(self, exc: BaseException) -> None:
        self.failure = exc
        self._fail_everything(exc)
        if self.engine_metrics is not None:
            self.engine_metrics.set_engines_alive(0)
        if self.on_death is not None:
            self.on_death(exc)

    def stats_reported(self, rank: int, stats: EngineStats, token_intervals: list[float]) -> None:
        self._core_stats[rank] = stats
        if self.engine_metrics is not None:
            self.engine_metrics.record_stats(stats, engine=str(rank))
            observe = self.engine_metrics.inter_token_latency.observe
            for interval in token_intervals:
                observe(interval)
        self._latest_stats = total_stats(self._core_stats.values())


def total_stats(stats: Any) -> EngineStats:
    """The sum of the cores' statistics (KV usage: over all their blocks)."""
    out = EngineStats()
    used = 0.0
    for s in stats:
        out.num_running += s.num_running
        out.num_waiting += s.num_waiting
        out.num_kv_blocks += s.num_kv_blocks
        out.num_free_blocks += s.num_free_blocks
        out.num_preemptions += s.num_preemptions
        out.prefix_cache_queries += s.prefix_cache_queries
        out.prefix_cache_hits += s.prefix_cache_hits
        out.prompt_tokens += s.prompt_tokens
        out.prompt_tokens_cached += s.prompt_tokens_cached
        out.prompt_tokens_computed += s.prompt_tokens_computed
        out.generation_tokens += s.generation_tokens
        used += s.kv_cache_usage * s.num_kv_blocks
    out.kv_cache_usage = used / out.num_kv_blocks if out.num_kv_blocks else 0.0
    return out


__all__ = ["AsyncMPEngine", "EngineDeadError", "total_stats"]
