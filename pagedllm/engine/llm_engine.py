"""The synchronous engine: add requests, run steps, get outputs."""

from __future__ import annotations

import atexit
import gc
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedllm.config import EngineConfig
from pagedllm.engine.engine_builder import EngineParts, build_engine_parts, log_engine_parts
from pagedllm.engine.engine_checks import check_priority
from pagedllm.engine.engine_tasks import FAULT_INJECTION_ENV
from pagedllm.engine.observe.stats import EngineStats
from pagedllm.engine.observe.step_events import StepEvents
from pagedllm.lora_request import LoRARequest
from pagedllm.model.config import ModelConfig
from pagedllm.model.pooling import PoolingConfig
from pagedllm.model.tokenizer import render_chat
from pagedllm.outputs import EmbeddingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched.scheduler import SchedulerOutput
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.phase_times import StepPhaseTimes
from pagedllm.worker.runner_output import StepSamples

if TYPE_CHECKING:
    from pagedllm.structured import StructuredOutputManager

logger = logging.getLogger("pagedllm")


def _freeze_startup_objects() -> None:
    """``gc.freeze`` what exists now; unfrozen at exit, so that the interpreter's final collection
    still releases it (native bindings report objects left uncollected)."""
    global _unfreeze_registered
    gc.collect()
    gc.freeze()
    if not _unfreeze_registered:
        atexit.register(gc.unfreeze)
        _unfreeze_registered = True


_unfreeze_registered = False


@dataclass
class LaunchedStep:
    """A step whose forward and sampling were launched: ``rows`` of
    ``scheduler_output.scheduled_requests`` get the tokens of ``sampled`` (still on the device until
    resolved)."""

    scheduler_output: SchedulerOutput
    rows: list[int]
    sampled: StepSamples | None

    @property
    def can_run_ahead(self) -> bool:
        """Whether the next step may be scheduled before this one's tokens reach the host."""
        return all(self.scheduler_output.scheduled_requests[r].request.can_sample_ahead for r in self.rows)


class LLMEngine:
    """The step loop: owns the scheduler, the KV cache manager, the input and output processors, and
    an executor that runs the model (device, weights, KV tensors), all built by
    :func:`~pagedllm.engine.engine_builder.build_engine_parts`. The engine talks to the executor
    through :class:`~pagedllm.worker.executor_protocol.ModelExecutor` only.

    Not thread-safe: one thread drives ``add_request``/``step``/``abort_request``.

    With ``async_scheduling`` a step is scheduled and launched before the previous step's tokens are
    on the host (at most one step is in flight): each ``step`` launches step k + 1, then resolves
    step k (detokenization, stop checks, outputs) while the device computes. Over ``p`` pipeline
    stages ``p - 1`` steps stay in flight, each holding a different group of requests, so that every
    stage works on a step (``SchedulerConfig.interleaved_steps``). Requests in flight hold
    ``num_pending_tokens``; one that finishes on a token found at resolution (EOS, a stop string)
    has one more token computed by the step already launched, which is dropped. A step whose
    requests need their latest token on the host to sample the next (see
    ``Request.can_sample_ahead``) is resolved before the next is scheduled.

    ``task`` is ``generate`` or ``embed`` (``config.task``, or from the architecture); what differs
    between them is ``task_strategy`` (:mod:`pagedllm.engine.engine_tasks`). An embed engine takes
    pooling requests (:class:`PoolingParams`) and runs :meth:`step_pooling` instead of :meth:`step`:
    each prompt is computed whole in one step and pooled into its embedding, and the request finishes
    in that step. An encoder model (BERT) runs on an encoder executor, with no KV cache (zero blocks).
    """

    def __init__(self, config: EngineConfig, parts: EngineParts | None = None) -> None:
        """An engine of ``config`` on ``parts``, which :func:`build_engine_parts` builds from it
        unless they are given (built from this ``config``)."""
        if parts is None:
            parts = build_engine_parts(config)
        elif parts.config is not config:
            raise ValueError("parts: built from another EngineConfig than the engine's config.")
        self.config = parts.config
        # The model's default sampling parameters that were found (a subset of temperature, top_p,
        # top_k, min_p, repetition_penalty); a request's own values win over them.
        self.default_sampling = parts.default_sampling
        self.task_strategy = parts.task  # what differs between generating and embedding
        self.task = parts.task.name
        self.speculative = parts.speculative
        self.executor = executor = parts.executor
        self.tokenizer = executor.tokenizer
        self.model_name = executor.model_name
        self.vocab_size = executor.model_config.vocab_size
        self.eos_token_ids = list(executor.model_config.eos_token_ids)
        self.max_model_len = executor.max_model_len
        self.device = executor.device
        self.proposer = parts.proposer
        self.num_drafts = 0  # request steps that verified drafts, total
        self.num_draft_tokens = 0  # draft tokens verified, total
        self.num_accepted_tokens = 0  # of those, accepted
        self.async_scheduling = parts.async_scheduling
        self.max_in_flight = parts.max_in_flight  # steps left in flight when step() returns
        self._in_flight: deque[LaunchedStep] = deque()  # oldest first
        # Test hook: the N-th step raises inside its launch, as a failing forward would.
        self._fault_at_step = parts.fault_at_step
        self.input_processor = parts.input_processor
        self._pooling_config = parts.pooling_config
        self.kv_cache_manager = parts.kv_cache_manager
        self.scheduler = parts.scheduler
        self.output_processor = parts.output_processor
        self.num_prompt_tokens = 0  # prompt tokens computed (stats: prompt_tokens_computed)
        self.step_events = StepEvents()  # a bounded record of the latest steps (the dashboard's)
        self.step_times = StepPhaseTimes()
        self.num_generation_tokens = 0
        self._idle = True  # no request ran since the executor last released idle memory
        # The objects made so far (model, tokenizer, torch and transformers modules) live as long as
        # the engine: keep them out of the collector's full passes, which the per-step objects of a
        # few hundred running requests would otherwise trigger every few dozen steps.
        _freeze_startup_objects()
        log_engine_parts(parts)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        return cls(config)

    @property
    def pooling_config(self) -> PoolingConfig:
        """The pooling of an embed engine (AttributeError for task 'generate')."""
        if self._pooling_config is None:
            raise AttributeError(f"pooling_config: this engine runs task {self.task!r}, which pools nothing.")
        return self._pooling_config

    @property
    def runner(self) -> ModelRunner:
        """The executor's model runner (for introspection: backend, CUDA graphs, KV tensors)."""
        return self.executor.runner  # ValueError for an encoder, which has none

    @property
    def model_config(self) -> ModelConfig:
        """The decoder's architecture (an encoder's, a :class:`~pagedllm.model.bert.BertConfig`, is
        ``executor.model_config``)."""
        config = self.executor.model_config
        if not isinstance(config, ModelConfig):
            raise ValueError(f"{self.model_name} is an encoder: see executor.model_config.")
        return config

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
        """Validate and queue a request: SamplingParams for a generate engine, PoolingParams for an
        embed engine (None: the defaults of either). ``priority`` orders requests under the ``priority``
        policy (lower first; only 0 under ``fcfs``); ``lora_request`` names the adapter it runs with
        (an engine with ``enable_lora``). Raises RequestError naming the field, changing nothing."""
        check_priority(priority, self.scheduler.config.policy, wire=False)
        self.task_strategy.add_request(request_id, prompt, params, arrival_time, priority, lora_request)

    @property
    def structured_output_manager(self) -> StructuredOutputManager:
        """Grammar compilation for structured outputs (see :class:`InputProcessor`)."""
        return self.input_processor.structured_output_manager

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (by the id given to add_request); their blocks are freed at once."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self.task_strategy.abort(rid)
        self._settle()

    def has_unfinished_requests(self) -> bool:
        return bool(self._in_flight) or self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.task_strategy.num_unfinished()

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run the model once; returns the requests that progressed.

        With ``async_scheduling`` the outputs are those of the step launched by the previous call.
        An embed engine runs :meth:`step_pooling` instead (ValueError here).
        """
        self.task_strategy.check_step()
        in_flight = self._in_flight
        outputs: list[RequestOutput] = []
        if self.scheduler.config.interleaved_steps == 1 and in_flight and not in_flight[-1].can_run_ahead:
            outputs = self._resolve(in_flight.popleft())
        launched = self._launch()
        while in_flight and (len(in_flight) >= self.max_in_flight or launched is None):
            outputs += self._resolve(in_flight.popleft())
            if launched is None:
                break  # nothing could be scheduled until the oldest step's tokens are in
        if launched is not None:
            if self.async_scheduling:
                in_flight.append(launched)
                self._settle()
            else:
                outputs += self._resolve(launched)
        self._note_idleness()
        return outputs

    def step_pooling(self) -> list[EmbeddingRequestOutput]:
        """Schedule prompts (each whole, under the step's budgets), pool them, and return their
        embeddings; every scheduled request finishes in this step, its KV blocks freed (embed engines)."""
        outputs = self.task_strategy.step_pooling(self)
        self._note_idleness()
        return outputs

    def _note_idleness(self) -> None:
        """Once the last request has finished, the executor gives freed host memory back (once per
        idle period, not every empty step)."""
        if self.has_unfinished_requests():
            self._idle = False
        elif not self._idle:
            self._idle = True
            self.executor.release_idle_memory()

    def _settle(self) -> None:
        """Resolve the steps in flight once every request in them has finished (all their tokens
        would be dropped), so that an engine without requests holds no step."""
        if all(
            s.request.is_finished
            for step in self._in_flight
            for s in step.scheduler_output.scheduled_requests
        ):
            while self._in_flight:
                self._resolve(self._in_flight.popleft())

    def _launch(self) -> LaunchedStep | None:
        """Schedule a step and launch its forward and sampling (None when nothing is scheduled)."""
        times = self.step_times
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            if scheduler_output.copies_out:
                self.executor.copy_blocks(scheduler_output)  # victims swapped out for nothing to run
            return None
        times.steps += 1
        times.schedule += time.perf_counter() - started
        try:
            if times.steps == self._fault_at_step:
                raise RuntimeError(f"injected fault at step {times.steps} ({FAULT_INJECTION_ENV})")
            launched = self.executor.launch(scheduler_output, times)
        except BaseException:  # blocks registered for content that was never written:
            self.kv_cache_manager.uncache(scheduler_output.newly_cached_blocks)
            raise
        prompt_logprobs = launched.prompt_logprobs
        for scheduled in scheduler_output.scheduled_requests:
            req = scheduled.request
            if prompt_logprobs and req.request_id in prompt_logprobs:
                self.output_processor.add_prompt_logprobs(req, *prompt_logprobs[req.request_id])
            start = req.num_computed_tokens
            if start < req.num_prompt_tokens:
                self.num_prompt_tokens += min(start + scheduled.num_tokens, req.num_prompt_tokens) - start
            if scheduled.needs_sample:  # the rows that get a token
                req.num_pending_tokens += 1
        self.scheduler.update_after_step(scheduler_output)
        recorded = time.perf_counter()
        self.step_events.record(scheduler_output, self, recorded - started)
        times.record += time.perf_counter() - recorded
        return LaunchedStep(scheduler_output, launched.sample_rows, launched.samples)

    def _resolve(self, step: LaunchedStep) -> list[RequestOutput]:
        """Bring a launched step's tokens to the host: stop checks, detokenization, outputs."""
        if step.sampled is None:
            return []
        started = time.perf_counter()
        sampled = step.sampled.output()  # waits for the device: counted with sampling
        self.step_times.sample += time.perf_counter() - started
        started = time.perf_counter()
        touched: dict[str, None] = {}
        scheduled = step.scheduler_output.scheduled_requests
        process_token = self.output_processor.process_token
        now = time.monotonic()
        generated = 0
        continuing: list[Request] = []  # requests that go on (they may get drafts)
        for j, row in enumerate(step.rows):
            req = scheduled[row].request
            req.num_pending_tokens -= 1
            if req.status.finished:
                continue  # finished (or aborted) while this step was in flight: its token is dropped
            tokens, logprobs = [sampled.token_ids[j]], [sampled.sampled_logprobs[j]]
            drafts = scheduled[row].draft_token_ids
            if sampled.accepted is not None and sampled.accepted_logprobs is not None:
                tokens[:0], logprobs[:0] = sampled.accepted[j], sampled.accepted_logprobs[j]
                # The KV of rejected drafts is not the request's: their slots are written again later.
                req.num_computed_tokens -= len(drafts) - len(sampled.accepted[j])
                self.num_drafts += bool(drafts)
                self.num_draft_tokens += len(drafts)
                self.num_accepted_tokens += len(sampled.accepted[j])
            for i, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
                generated += 1
                top = sampled.logprobs[j] if i == len(tokens) - 1 else None
                status = process_token(req, token, logprob, top, now)
                if status is not None:
                    self.scheduler.finish_request(req, status)
                    break
            else:
                continuing.append(req)
            assert req.parent_id is not None
            touched[req.parent_id] = None
        self.num_generation_tokens += generated
        if self.proposer is not None and continuing:
            for req, drafts in zip(continuing, self.proposer.propose_all(continuing), strict=True):
                req.spec_token_ids = drafts
        outputs = []
        for pid in touched:
            parent = self.output_processor.parents.get(pid)
            if parent is None or (parent.final_only and not parent.finished):
                continue
            output = parent.output()
            outputs.append(output)
            if output.finished:
                self.output_processor.remove(pid)
        self.step_times.outputs += time.perf_counter() - started
        self.scheduler.step_done(step.scheduler_output)  # its time, for the step-time budget
        return outputs

    # -- introspection ----------------------------------------------------------------------
    def pop_token_intervals(self) -> list[float]:
        """Seconds between successive tokens of each sequence since the previous call (the latest
        65,536 at most), in the order the tokens came."""
        intervals = self.output_processor.token_intervals
        out = list(intervals)
        intervals.clear()
        return out

    def get_stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache_manager.usage() if self.kv_cache_manager.pool.num_blocks else 0.0,
            num_kv_blocks=self.kv_cache_manager.pool.num_blocks,
            num_free_blocks=self.kv_cache_manager.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv_cache_manager.stats.queries,
            prefix_cache_hits=self.kv_cache_manager.stats.hits,
            prompt_tokens=self.output_processor.num_prompt_tokens,
            prompt_tokens_cached=self.output_processor.num_cached_prompt_tokens,
            prompt_tokens_computed=self.num_prompt_tokens,
            generation_tokens=self.num_generation_tokens,
            spec_drafts=self.num_drafts,
            spec_draft_tokens=self.num_draft_tokens,
            spec_accepted_tokens=self.num_accepted_tokens,
            **self._swap_stats(),
        )

    def _swap_stats(self) -> dict[str, int]:
        host = self.kv_cache_manager.host
        if host is None:
            return {}
        block_bytes = self.runner.kv_bytes_per_block
        return {
            "num_swapped": self.scheduler.num_swapped,
            "num_host_blocks": host.pool.num_blocks,
            "num_free_host_blocks": host.pool.num_free_blocks,
            "swapped_out": host.stats.swapped_out,
            "swapped_in": host.stats.swapped_in,
            "swap_out_bytes": host.stats.blocks_out * block_bytes,
            "swap_in_bytes": host.stats.blocks_in * block_bytes,
            "host_prefix_cache_hits": host.stats.host_hit_tokens,
        }

    def shutdown(self) -> None:
        """Stop what the executor started (the other ranks of a parallel model); the engine cannot
        step afterwards."""
        self.executor.shutdown()

    def check_idle(self) -> None:
        """Assert no request is left and every KV block is free (cached or not)."""
        assert not self.scheduler.has_unfinished_requests(), "requests still queued"
        assert not self._in_flight, "a step is still in flight"
        self.task_strategy.check_idle()
        self.kv_cache_manager.check_idle()
        if self.proposer is not None:
            self.proposer.check_idle()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text of a conversation (see :func:`~pagedllm.model.tokenizer.render_chat`)."""
        return render_chat(self.tokenizer, messages, add_generation_prompt, tools)
