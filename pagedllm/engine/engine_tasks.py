"""An engine's task as a strategy: what differs between an engine that generates and one that embeds.

:class:`~pagedllm.engine.llm_engine.LLMEngine` holds one :class:`EngineTask` and asks it, without
testing which it is, to take a request, abort one, count and check what is left, and say which of the
engine's two step methods runs its steps:

- :class:`GenerateTask` (task ``generate``): requests with :class:`SamplingParams`, kept by the
  output processor (one parent, ``n`` sequences); ``LLMEngine.step`` runs the steps (the step loop,
  scheduling ahead and steps in flight stay in the engine).
- :class:`PoolingTask` (task ``embed``): requests with :class:`PoolingParams`, kept by the pooling
  processor; :meth:`PoolingTask.step_pooling` runs the steps: every scheduled prompt is computed
  whole, pooled, and finishes in its step.

Each refuses the other's requests and step method with the error the engine has always given,
naming the task and how to start an engine for the other one.
"""

from __future__ import annotations

import os
import time
from typing import Protocol

from pagedllm.engine.engine_checks import check_new_request_id, check_sequence_ids
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.pooling_processor import PoolingProcessor
from pagedllm.errors import RequestError
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import EmbeddingRequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.request import RequestStatus
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched.kv_cache_manager import KVCacheManager
from pagedllm.sched.scheduler import Scheduler
from pagedllm.worker.executor_protocol import ModelExecutor
from pagedllm.worker.phase_times import StepPhaseTimes

# Environment variable naming an engine step that fails on purpose (for tests of engine death).
FAULT_INJECTION_ENV = "PAGEDLLM_INJECT_FAULT_AT_STEP"


def injected_fault_step() -> int:
    """The step that fails on purpose (``FAULT_INJECTION_ENV``; 0: none)."""
    return int(os.environ.get(FAULT_INJECTION_ENV) or 0)


class StepHost(Protocol):
    """The engine's step state that a task's own step runs on (the engine itself)."""

    kv_cache_manager: KVCacheManager
    executor: ModelExecutor
    output_processor: OutputProcessor
    step_times: StepPhaseTimes
    num_prompt_tokens: int  # prompt tokens computed, total


class EngineTask(Protocol):
    """What the engine asks of its task (see the module docstring)."""

    @property
    def name(self) -> str:
        """``generate`` or ``embed`` (``LLMEngine.task``)."""
        ...

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams | None,
        arrival_time: float | None,
        priority: int,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate and queue a request (its priority already checked); RequestError naming the
        field, changing nothing."""
        ...

    def abort(self, request_id: str) -> None:
        """Abort a request by the id it was added with (unknown ids: nothing)."""
        ...

    def num_unfinished(self) -> int:
        """Requests added and not yet finished or aborted."""
        ...

    def check_idle(self) -> None:
        """Assert the task holds no request state."""
        ...

    def check_step(self) -> None:
        """Raise ValueError where ``LLMEngine.step`` does not run this task's steps."""
        ...

    def step_pooling(self, host: StepHost) -> list[EmbeddingRequestOutput]:
        """Run one pooling step on ``host`` (ValueError where the task does not pool)."""
        ...


class GenerateTask:
    """Task ``generate``: requests become sequences of the output processor; ``step`` runs them."""

    name = "generate"

    def __init__(
        self,
        model_name: str,
        scheduler: Scheduler,
        input_processor: InputProcessor,
        output_processor: OutputProcessor,
    ) -> None:
        self.model_name = model_name
        self.scheduler = scheduler
        self.input_processor = input_processor
        self.output_processor = output_processor

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams | None,
        arrival_time: float | None,
        priority: int,
        lora_request: LoRARequest | None = None,
    ) -> None:
        if isinstance(params, PoolingParams):
            raise RequestError(
                None,
                f"This engine runs task 'generate' ({self.model_name}): it does not embed; start it with "
                "task='embed' (--task embed) for embeddings.",
            )
        params = params or SamplingParams()
        output_processor = self.output_processor
        check_new_request_id(request_id, output_processor.parents)
        processed = self.input_processor.process(request_id, prompt, params, arrival_time, lora_request)
        sequence_ids = [s.request_id for s in processed.sequences]
        check_sequence_ids(request_id, sequence_ids, output_processor.sequences)
        output_processor.add_request(request_id, processed.prompt, processed.sequences)
        for req in processed.sequences:
            req.priority = priority
            self.scheduler.add_request(req)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort_requests(self.output_processor.child_ids(request_id))
        self.output_processor.remove(request_id)

    def num_unfinished(self) -> int:
        return len(self.output_processor.parents)

    def check_idle(self) -> None:
        assert not self.output_processor.parents, "request state left behind"

    def check_step(self) -> None:
        """Generation steps are ``LLMEngine.step``'s."""

    def step_pooling(self, host: StepHost) -> list[EmbeddingRequestOutput]:
        raise ValueError("This engine runs task 'generate': its steps are run by step().")


class PoolingTask:
    """Task ``embed``: requests are pooling requests; :meth:`step_pooling` runs them.

    ``encoder`` says whether the model is an encoder (which cannot be started to generate);
    ``fault_at_step`` is the step that fails on purpose (0: none).
    """

    name = "embed"

    def __init__(
        self,
        model_name: str,
        encoder: bool,
        scheduler: Scheduler,
        pooling: PoolingProcessor,
        fault_at_step: int = 0,
    ) -> None:
        self.model_name = model_name
        self.encoder = encoder
        self.scheduler = scheduler
        self.pooling = pooling
        self.fault_at_step = fault_at_step

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams | None,
        arrival_time: float | None,
        priority: int,
        lora_request: LoRARequest | None = None,
    ) -> None:
        if isinstance(params, SamplingParams):
            how = "a decoder model" if self.encoder else "this model"
            raise RequestError(
                None,
                f"This engine runs task 'embed' ({self.model_name}): it embeds (LLM.embed, /v1/embeddings) "
                f"and does not generate; to generate, start {how} with task='generate' (--task generate).",
            )
        if lora_request is not None:
            raise RequestError("lora_request", "LoRA adapters apply to generation; this engine embeds.")
        request = self.pooling.make_request(request_id, prompt, params or PoolingParams(), arrival_time)
        request.priority = priority
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> None:
        if self.pooling.requests.pop(request_id, None) is not None:
            self.scheduler.abort_requests([request_id])

    def num_unfinished(self) -> int:
        return len(self.pooling.requests)

    def check_idle(self) -> None:
        assert not self.pooling.requests, "pooling request state left behind"

    def check_step(self) -> None:
        raise ValueError("This engine runs task 'embed': its steps are run by step_pooling().")

    def step_pooling(self, host: StepHost) -> list[EmbeddingRequestOutput]:
        """Schedule prompts (each whole, under the step's budgets), pool them, and return their
        embeddings; every scheduled request finishes in this step, its KV blocks freed."""
        times = host.step_times
        scheduler = self.scheduler
        started = time.perf_counter()
        scheduler_output = scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        times.steps += 1
        times.schedule += time.perf_counter() - started
        try:
            if times.steps == self.fault_at_step:
                raise RuntimeError(f"injected fault at step {times.steps} ({FAULT_INJECTION_ENV})")
            pooled = host.executor.pool(scheduler_output, self.pooling.config.pooling_type, times)
        except BaseException:
            host.kv_cache_manager.uncache(scheduler_output.newly_cached_blocks)
            raise
        scheduler.update_after_step(scheduler_output)
        started = time.perf_counter()
        requests = [s.request for s in scheduler_output.scheduled_requests]
        for scheduled in scheduler_output.scheduled_requests:
            host.num_prompt_tokens += scheduled.num_tokens
            host.output_processor.count_prompt(scheduled.request)
            scheduler.finish_request(scheduled.request, RequestStatus.FINISHED_STOPPED)
        outputs = self.pooling.outputs(requests, pooled)
        times.outputs += time.perf_counter() - started
        return outputs
