"""The synchronous engine: add requests, run steps, get outputs."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager, uniform_sliding_window
from pagedllm.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedllm.engine.engine_checks import (
    check_new_request_id,
    check_priority,
    check_sequence_ids,
    check_speculative,
    resolve_step_time,
)
from pagedllm.engine.input_processor import InputLimits, InputProcessor
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.pooling_processor import PoolingLimits, PoolingProcessor, resolve_task
from pagedllm.engine.stats import EngineStats
from pagedllm.engine.step_events import StepEvents
from pagedllm.errors import RequestError
from pagedllm.model.config import ModelConfig
from pagedllm.model.generation_config import load_generation_defaults
from pagedllm.model.pooling import resolve_pooling_config
from pagedllm.model.tokenizer import render_chat
from pagedllm.outputs import EmbeddingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec.config import SpeculativeConfig
from pagedllm.spec.proposer import NgramProposer, Proposer
from pagedllm.worker.draft_model import DraftModelProposer
from pagedllm.worker.encoder_executor import EncoderExecutor, is_encoder_model
from pagedllm.worker.executor import Executor
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.phase_times import StepPhaseTimes
from pagedllm.worker.runner_output import StepSamples

if TYPE_CHECKING:
    from pagedllm.structured import StructuredOutputManager

logger = logging.getLogger("pagedllm")

# Environment variable naming an engine step that fails on purpose (for tests of engine death).
FAULT_INJECTION_ENV = "PAGEDLLM_INJECT_FAULT_AT_STEP"


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
    an :class:`~pagedllm.worker.executor.Executor` that runs the model (device, weights, KV tensors).

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

    ``task`` is ``generate`` or ``embed`` (``config.task``, or from the architecture). An embed engine
    takes pooling requests (:class:`PoolingParams`) and runs :meth:`step_pooling` instead of
    :meth:`step`: each prompt is computed whole in one step and pooled into its embedding, and the
    request finishes in that step. An encoder model (BERT) runs on an :class:`EncoderExecutor`, with no
    KV cache (zero blocks).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Read (and checked) before the weights load, so a bad --generation-config fails fast.
        generation = load_generation_defaults(config.generation_config, config.model)
        # The model's default sampling parameters that were found (a subset of temperature, top_p,
        # top_k, min_p, repetition_penalty); a request's own values win over them.
        self.default_sampling: dict[str, float | int] = dict(generation.values)
        encoder = is_encoder_model(config.model)
        self.task = resolve_task(config.task, encoder, config.model or "the default model")
        if self.task != "embed" and (config.pooling_type is not None or config.pooling_normalize is not None):
            raise ValueError("pooling_type and pooling_normalize apply to task 'embed' only.")
        self.speculative = check_speculative(config, self.task)  # before any rank process starts
        if self.task == "embed" and (config.async_scheduling or config.swap_space):
            raise ValueError(
                f"{'async_scheduling' if config.async_scheduling else 'swap_space'} does not apply to task "
                "embed: a prompt is computed and pooled in one step."
            )
        self.executor: Executor | EncoderExecutor
        if config.world_size > 1 or config.nnodes > 1:
            if encoder or config.node_rank:
                raise ValueError(
                    "tensor_parallel_size / pipeline_parallel_size: encoder models run on one rank."
                    if encoder
                    else f"node_rank {config.node_rank}: only node 0 runs the engine (start the others "
                    "with `pagedllm serve --node-rank N`)."
                )
            from pagedllm.worker.parallel_executor import ParallelExecutor

            self.executor = ParallelExecutor(config)
        else:
            self.executor = EncoderExecutor(config) if encoder else Executor(config)
        executor = self.executor
        self.tokenizer = executor.tokenizer
        self.model_name = executor.model_name
        self.vocab_size = executor.model_config.vocab_size
        self.eos_token_ids = list(executor.model_config.eos_token_ids)
        self.max_model_len = executor.max_model_len
        self.device = executor.device
        self.proposer = self._make_proposer(self.speculative)
        if self.speculative is not None:
            logger.info(
                "Speculative decoding: %s; scheduling ahead is off with it, and steps that verify drafts "
                "run without CUDA graphs.",
                self.speculative,
            )
        self.num_drafts = 0  # request steps that verified drafts, total
        self.num_draft_tokens = 0  # draft tokens verified, total
        self.num_accepted_tokens = 0  # of those, accepted
        # On by default where it pays: a GPU computes while the host schedules, and pipeline stages
        # work on different steps (not with speculative decoding: drafts follow the latest token).
        self.async_scheduling = (
            config.async_scheduling
            if config.async_scheduling is not None
            else (self.device.type == "cuda" or config.pipeline_parallel_size > 1) and self.proposer is None
        ) and self.task == "generate"
        # Steps launched back to back that the executor's pipeline stages run at once (1: none).
        interleaved = (
            executor.interleave_steps() if self.async_scheduling and isinstance(executor, Executor) else 1
        )
        self.max_in_flight = max(1, interleaved - 1)  # steps left in flight when step() returns
        self._in_flight: deque[LaunchedStep] = deque()  # oldest first
        # Test hook: the N-th step raises inside its launch, as a failing forward would.
        self._fault_at_step = int(os.environ.get(FAULT_INJECTION_ENV) or 0)
        num_blocks = executor.num_kv_blocks
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.eos_token_ids,
            InputLimits(
                vocab_size=self.vocab_size,
                max_model_len=self.max_model_len,
                max_logprobs=config.max_logprobs,
                block_size=config.block_size,
                num_kv_blocks=num_blocks,
                max_num_seqs=config.max_num_seqs,
            ),
        )
        prefix_caching = config.enable_prefix_caching
        if self.task == "embed":
            path = executor.checkpoint_path  # a folder may hold a sentence-transformers pooling config
            self.pooling_config = resolve_pooling_config(
                path if os.path.isdir(path) else None,
                encoder=encoder,
                hidden_size=executor.model_config.hidden_size,
                matryoshka_dimensions=(
                    executor.model_config.matryoshka_dimensions
                    if isinstance(executor, EncoderExecutor)
                    else None
                ),
                pooling_type=config.pooling_type,
                normalize=config.pooling_normalize,
            )
            # Only the last token's state survives a cached prefix; mean and CLS pooling need every row.
            prefix_caching = prefix_caching and not encoder and self.pooling_config.pooling_type == "last"
            self.pooling = PoolingProcessor(
                self.input_processor,
                self.pooling_config,
                PoolingLimits(self.max_model_len, config.block_size, None if encoder else num_blocks),
            )
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            config.block_size,
            prefix_caching,
            sliding_window=uniform_sliding_window(executor.model_config),
            num_host_blocks=executor.host_kv.num_blocks
            if isinstance(executor, Executor) and executor.host_kv
            else 0,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                executor.max_num_batched_tokens,
                whole_prompts=self.task == "embed",
                uses_kv_cache=not encoder,
                interleaved_steps=interleaved,
                policy=config.scheduling_policy,
                preemption_mode=config.preemption_mode,
                costs=getattr(executor, "preemption_costs", None),
                max_step_time_s=resolve_step_time(config, self.task, self.device.type, interleaved),
            ),
            self.kv_cache_manager,
        )
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self.num_prompt_tokens = 0  # prompt tokens computed (stats: prompt_tokens_computed)
        self.step_events = StepEvents()  # a bounded record of the latest steps (the dashboard's)
        self.step_times = StepPhaseTimes()
        self.num_generation_tokens = 0
        # The objects made so far (model, tokenizer, torch and transformers modules) live as long as
        # the engine: keep them out of the collector's full passes, which the per-step objects of a
        # few hundred running requests would otherwise trigger every few dozen steps.
        _freeze_startup_objects()
        tokens = num_blocks * config.block_size
        logger.info(
            "Loaded %s on %s (%s, %s attention) in %.1fs. KV cache: %d blocks x %d tokens = %d tokens "
            "(%.0f MiB); maximum concurrency for %d-token requests: %.2fx; scheduling ahead %s; task %s",
            self.model_name,
            self.device,
            str(executor.dtype).removeprefix("torch."),
            executor.attention_backend,
            executor.load_time_s,
            num_blocks,
            config.block_size,
            tokens,
            executor.kv_cache_bytes / 2**20,
            self.max_model_len,
            tokens / self.max_model_len,
            "on" if self.async_scheduling else "off",
            self.task,
        )
        self._log_host_tier()

    def _make_proposer(self, spec: SpeculativeConfig | None) -> Proposer | None:
        """Prompt lookup, or a draft model loaded next to the target (its own KV cache)."""
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec, self.max_model_len)
        assert isinstance(self.executor, Executor)
        return DraftModelProposer(spec, self.config, self.executor)

    def _log_host_tier(self) -> None:
        host, costs = self.kv_cache_manager.host, self.scheduler.config.costs
        if host is not None and costs is not None:
            logger.info(
                "Host KV tier: %d blocks (%.0f MiB); preemption %s; measured copies %.2f GB/s, products "
                "%.1f GFLOP/s",
                host.pool.num_blocks,
                host.pool.num_blocks * costs.block_bytes / 2**20,
                self.config.preemption_mode,
                costs.copy_bytes_per_s / 1e9,
                costs.flops_per_s / 1e9,
            )

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        return cls(config)

    @property
    def runner(self) -> ModelRunner:
        """The executor's model runner (for introspection: backend, CUDA graphs, KV tensors)."""
        executor = self.executor
        if isinstance(executor, EncoderExecutor):
            raise ValueError(f"{self.model_name} is an encoder: it has no paged model runner.")
        return executor.runner

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
    ) -> None:
        """Validate and queue a request: SamplingParams for a generate engine, PoolingParams for an
        embed engine (None: the defaults of either). ``priority`` orders requests under the ``priority``
        policy (lower first; only 0 under ``fcfs``). Raises RequestError naming the field, changing nothing."""
        check_priority(priority, self.scheduler.config.policy, wire=False)
        if self.task == "embed":
            if isinstance(params, SamplingParams):
                how = "a decoder model" if isinstance(self.executor, EncoderExecutor) else "this model"
                raise RequestError(
                    None,
                    f"This engine runs task 'embed' ({self.model_name}): it embeds (LLM.embed, /v1/embeddings) "
                    f"and does not generate; to generate, start {how} with task='generate' (--task generate).",
                )
            request = self.pooling.make_request(request_id, prompt, params or PoolingParams(), arrival_time)
            request.priority = priority
            self.scheduler.add_request(request)
            return
        if isinstance(params, PoolingParams):
            raise RequestError(
                None,
                f"This engine runs task 'generate' ({self.model_name}): it does not embed; start it with "
                "task='embed' (--task embed) for embeddings.",
            )
        params = params or SamplingParams()
        check_new_request_id(request_id, self.output_processor.parents)
        processed = self.input_processor.process(request_id, prompt, params, arrival_time)
        sequence_ids = [s.request_id for s in processed.sequences]
        check_sequence_ids(request_id, sequence_ids, self.output_processor.sequences)
        self.output_processor.add_request(request_id, processed.prompt, processed.sequences)
        for req in processed.sequences:
            req.priority = priority
            self.scheduler.add_request(req)

    @property
    def structured_output_manager(self) -> StructuredOutputManager:
        """Grammar compilation for structured outputs (see :class:`InputProcessor`)."""
        return self.input_processor.structured_output_manager

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (by the id given to add_request); their blocks are freed at once."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            if self.task == "embed" and self.pooling.requests.pop(rid, None) is not None:
                self.scheduler.abort_requests([rid])
                continue
            child_ids = self.output_processor.child_ids(rid)
            self.scheduler.abort_requests(child_ids)
            self.output_processor.remove(rid)
        self._settle()

    def has_unfinished_requests(self) -> bool:
        return bool(self._in_flight) or self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        pooling = len(self.pooling.requests) if self.task == "embed" else 0
        return len(self.output_processor.parents) + pooling

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run the model once; returns the requests that progressed.

        With ``async_scheduling`` the outputs are those of the step launched by the previous call.
        An embed engine runs :meth:`step_pooling` instead (ValueError here).
        """
        if self.task == "embed":
            raise ValueError("This engine runs task 'embed': its steps are run by step_pooling().")
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
        return outputs

    def step_pooling(self) -> list[EmbeddingRequestOutput]:
        """Schedule prompts (each whole, under the step's budgets), pool them, and return their
        embeddings; every scheduled request finishes in this step, its KV blocks freed (embed engines)."""
        if self.task != "embed":
            raise ValueError("This engine runs task 'generate': its steps are run by step().")
        times = self.step_times
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        times.steps += 1
        times.schedule += time.perf_counter() - started
        try:
            if times.steps == self._fault_at_step:
                raise RuntimeError(f"injected fault at step {times.steps} ({FAULT_INJECTION_ENV})")
            pooled = self.executor.pool(scheduler_output, self.pooling_config.pooling_type, times)
        except BaseException:
            self.kv_cache_manager.uncache(scheduler_output.newly_cached_blocks)
            raise
        self.scheduler.update_after_step(scheduler_output)
        started = time.perf_counter()
        requests = [s.request for s in scheduler_output.scheduled_requests]
        for scheduled in scheduler_output.scheduled_requests:
            self.num_prompt_tokens += scheduled.num_tokens
            self.output_processor.count_prompt(scheduled.request)
            self.scheduler.finish_request(scheduled.request, RequestStatus.FINISHED_STOPPED)
        outputs = self.pooling.outputs(requests, pooled)
        times.outputs += time.perf_counter() - started
        return outputs

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
            if scheduler_output.copies_out and isinstance(self.executor, Executor):
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
        stop = getattr(self.executor, "shutdown", None)
        if stop is not None:
            stop()

    def check_idle(self) -> None:
        """Assert no request is left and every KV block is free (cached or not)."""
        assert not self.scheduler.has_unfinished_requests(), "requests still queued"
        assert not self._in_flight, "a step is still in flight"
        assert not self.output_processor.parents, "request state left behind"
        assert self.task != "embed" or not self.pooling.requests, "pooling request state left behind"
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
