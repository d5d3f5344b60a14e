"""The offline engine over core processes: ``LLM(..., multiprocess=True)``.

:class:`MPLLMEngine` offers the part of :class:`~pagedllm.engine.llm_engine.LLMEngine` that
:class:`~pagedllm.entrypoints.llm.LLM` uses (``add_request``, ``step``, ``step_pooling``,
``abort_request``, ``has_unfinished_requests``, the tokenizer and model facts) while the model runs in
``data_parallel_size`` engine-core processes of this machine. Requests are sent without waiting for
the core's answer, so that a batch reaches the core at once; a request the core refuses raises its
``ValueError`` from the next :meth:`step`. A request's ``priority`` is checked here first, against
the policy the cores reported, so a bad one raises from :meth:`add_request` and is never sent.
Outputs are the cores' own, so they equal in-process ones.

The core processes stop with :meth:`shutdown`, when the engine is garbage collected, or at exit.
"""

from __future__ import annotations

import logging
import queue
import time
import weakref
from collections.abc import Iterable
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.engine_checks import check_new_request_id, check_priority
from pagedllm.engine.errors import EngineDeadError, RequestError
from pagedllm.engine.input_processor import tokenize_prompt
from pagedllm.engine.observe.stats import EngineStats
from pagedllm.engine.observe.step_events import StepRecord
from pagedllm.engine.proc.async_mp_engine import total_stats
from pagedllm.engine.proc.core_client import CoreClient
from pagedllm.engine.proc.launch import (
    CoreOptions,
    LocalCores,
    frontend_addresses,
    start_local_cores,
)
from pagedllm.lora_request import LoRARequest
from pagedllm.model.loader import load_model_tokenizer
from pagedllm.model.tokenizer import render_chat, with_chat_template
from pagedllm.outputs import EmbeddingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import free_port_range

logger = logging.getLogger("pagedllm")

# How long to wait for the cores to load and join.
START_TIMEOUT_S = 900.0
# How long check_idle waits for the cores' statistics to show them idle.
IDLE_TIMEOUT_S = 10.0


def _close(client: CoreClient, cores: LocalCores) -> None:
    client.close()
    cores.stop(timeout=5.0)


class _Sink:
    """The client's listener: queues its events for the engine's caller (apart from the engine, so
    that the client does not keep the engine alive)."""

    def __init__(self) -> None:
        self.events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.core_stats: dict[int, EngineStats] = {}
        self.fresh: set[int] = set()  # ranks that reported since the set was last cleared
        self.dead: BaseException | None = None

    def accepted(self, request_id: str) -> None:
        pass

    def rejected(self, request_id: str, exc: BaseException) -> None:
        self.events.put(("rejected", (request_id, exc)))

    def outputs(self, outputs: list[RequestOutput | EmbeddingRequestOutput]) -> None:
        self.events.put(("outputs", outputs))

    def failed(self, request_ids: list[str], exc: BaseException) -> None:
        self.events.put(("failed", (request_ids, exc)))

    def core_lost(self, rank: int) -> None:
        self.core_stats.pop(rank, None)

    def all_dead(self, exc: BaseException) -> None:
        self.dead = exc
        self.events.put(("dead", exc))

    def stats_reported(self, rank: int, stats: EngineStats, token_intervals: list[float]) -> None:
        self.core_stats[rank] = stats
        self.fresh.add(rank)

    def steps_reported(self, rank: int, steps: list[StepRecord]) -> None:
        pass  # the offline engine shows no dashboard

    def state_reported(self, rank: int, query_id: int, state: bytes | None) -> None:
        pass


class MPLLMEngine:
    """An offline engine whose model runs in core processes (see the module docstring).

    Not thread-safe: one thread calls it, as with :class:`LLMEngine`.
    """

    def __init__(self, config: EngineConfig, data_parallel_size: int = 1, routing: str = "prefix") -> None:
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {data_parallel_size}.")
        self.config = config
        tokenizer = with_chat_template(
            load_model_tokenizer(config.model, config.tokenizer), config.chat_template
        )
        address = frontend_addresses("127.0.0.1", free_port_range("127.0.0.1", 1), 1)
        ranks = list(range(data_parallel_size))
        options = CoreOptions(
            rank=0,
            frontend_address=address[0],
            log_stats_interval=None,
            report_cache_events=data_parallel_size > 1,
            log_level=logging.getLevelName(logging.getLogger("pagedllm").getEffectiveLevel()).lower(),
        )
        self._sink = _Sink()
        self._events = self._sink.events
        self._core_stats = self._sink.core_stats
        self.cores = start_local_cores(config, ranks, options)
        self.client = CoreClient(
            index=0,
            frontend_addresses=address,
            ranks=ranks,
            listener=self._sink,
            pids=self.cores.pids,
            pid_exit=self.cores.exitcode,
            routing=routing,
        )
        self._finalizer = weakref.finalize(self, _close, self.client, self.cores)
        try:
            info = self.client.wait_for_cores(START_TIMEOUT_S)
        except RuntimeError as exc:
            self._finalizer()
            raise ValueError(f"Could not start the engine: {exc}") from None
        # The tokenizer and the model's facts, as a front-end sees them (what LLM reads of an engine).
        self.info = info
        self.tokenizer = tokenizer
        self.model_name = info.model_name
        self.task = info.task
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.eos_token_ids = list(info.eos_token_ids)
        self.default_sampling: dict[str, float | int] = dict(info.default_sampling)
        self.pooling_config = info.pooling_config
        self.scheduling_policy = info.scheduling_policy
        self.max_num_batched_tokens = info.max_num_batched_tokens or info.max_model_len
        self.input_processor = self  # .tokenize(prompt), as beam search asks
        self._unfinished: set[str] = set()
        self.client.start()

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """A prompt's text (None for ids) and token ids, checked as the engine checks them."""
        return tokenize_prompt(self.tokenizer, prompt, self.vocab_size)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        return render_chat(self.tokenizer, messages, add_generation_prompt, tools)

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Send a request to a core (with its adapter, ``lora_request``). Raises ValueError at once for
        an empty or out-of-vocabulary prompt, a reused id, parameters of the other task or a ``priority`` that is not an integer
        (or not 0 under ``fcfs``); the core's own checks raise from the next :meth:`step`."""
        if self._sink.dead is not None:
            raise EngineDeadError(self.client.dead_message())
        check_priority(priority, self.scheduling_policy)
        check_new_request_id(request_id, self._unfinished)
        if self.task == "embed" and isinstance(params, SamplingParams):
            raise RequestError(
                None, f"This engine runs task 'embed' ({self.model_name}): it does not generate."
            )
        if self.task == "generate" and isinstance(params, PoolingParams):
            raise RequestError(
                None, f"This engine runs task 'generate' ({self.model_name}): it does not embed."
            )
        if params is None:
            params = PoolingParams() if self.task == "embed" else SamplingParams()
        text, ids = self.tokenize(prompt)
        self._unfinished.add(request_id)
        self.client.add(request_id, text, ids, params, priority, lora_request)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        live = [rid for rid in ids if rid in self._unfinished]
        self._unfinished.difference_update(live)
        if live:
            self.client.abort(live)

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def get_num_unfinished_requests(self) -> int:
        return len(self._unfinished)

    def step(self) -> list[RequestOutput]:
        """Wait for the next outputs of this engine's requests (at least one, unless none is
        unfinished); raises a refused request's error, or EngineDeadError when the cores died."""
        return self._next_outputs()  # type: ignore[return-value]

    def step_pooling(self) -> list[EmbeddingRequestOutput]:
        return self._next_outputs()  # type: ignore[return-value]

    def _next_outputs(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        outputs: list[RequestOutput | EmbeddingRequestOutput] = []
        block = True
        while self._unfinished or not self._events.empty():
            try:
                kind, payload = self._events.get(timeout=0.5) if block else self._events.get_nowait()
            except queue.Empty:
                if outputs or not block:
                    break
                continue
            if kind == "outputs":
                for out in payload:
                    if out.request_id in self._unfinished:
                        outputs.append(out)
                        if out.finished:
                            self._unfinished.discard(out.request_id)
                block = False
            elif kind == "rejected":
                rid, exc = payload
                if rid in self._unfinished:
                    self._unfinished.discard(rid)
                    raise exc
            elif kind == "failed":
                ids, exc = payload
                if self._unfinished.intersection(ids):
                    self._unfinished.difference_update(ids)
                    raise exc
            elif kind == "dead":
                self._unfinished.clear()
                raise payload
        return outputs

    # -- introspection ------------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        """The sum of the cores' latest statistics (at most a heartbeat old)."""
        return total_stats(list(self._core_stats.values()))

    def reset_prefix_cache(self) -> bool:
        """Ask every core to forget its cached blocks, after the requests already sent (a core whose
        requests hold blocks keeps them and logs a warning)."""
        self.client.reset_prefix_cache()
        return True

    def core_stats(self) -> dict[int, EngineStats]:
        """Each core's latest statistics, by rank (at most a heartbeat old)."""
        return dict(self._core_stats)

    def wait_for_stats(self, timeout: float = 5.0) -> dict[int, EngineStats]:
        """Each core's statistics once every core has reported after this call (so they include
        everything finished before it)."""
        deadline = time.monotonic() + timeout
        self._sink.fresh.clear()
        while len(self._sink.fresh) < self.client.num_alive and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.core_stats()

    def check_idle(self) -> None:
        """Assert that no request of this engine is left and that every core, idle, holds no KV
        block (waits for the cores' statistics to catch up)."""
        assert not self._unfinished, "requests still unfinished"
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while True:
            stats = list(self._core_stats.values())
            idle = len(stats) == self.client.num_alive and all(
                s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_kv_blocks
                for s in stats
            )
            if idle:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"engine cores not idle: {stats}")
            time.sleep(0.05)

    def shutdown(self) -> None:
        """Stop the core processes (idempotent)."""
        self._finalizer()


__all__ = ["MPLLMEngine"]
