"""What the engine needs from an executor, stated once: :class:`ModelExecutor`.

Every executor implements it: the in-process :class:`~pagedllm.worker.executor.Executor`, the
tensor/pipeline-parallel :class:`~pagedllm.worker.parallel_executor.ParallelExecutor` (rank 0 drives
the others), the draft model's :class:`~pagedllm.worker.draft_model.DraftExecutor`, and the encoder's
:class:`~pagedllm.worker.encoder_executor.EncoderExecutor`. The engine talks to this protocol only,
never to a concrete class: what differs between executors is a member with an honest value rather
than a type to test for.

- The host tier of KV blocks: ``num_host_kv_blocks`` (0: none) and :meth:`copy_blocks` (an executor
  without a tier is never handed a copy, and raises if it is).
- Steps that overlap: :meth:`interleave_steps` (1 where steps run one after another).
- The preemption cost model: ``preemption_costs`` (None: not measured, no host tier).
- Generation and pooling: :meth:`launch` (an encoder raises: it does not generate) and :meth:`pool`.
- Going idle: :meth:`release_idle_memory` (the CPU's freed activations back to the OS).
- LoRA adapters: ``lora`` (None where they are off).
- The paged model runner, for introspection: ``runner`` (an encoder raises ValueError: it has none).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from pagedllm.model.bert import BertConfig
from pagedllm.model.config import ModelConfig
from pagedllm.sched.preemption import PreemptionCosts
from pagedllm.sched.scheduler import SchedulerOutput
from pagedllm.worker.lora_steps import LoRAWorker
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.phase_times import StepPhaseTimes
from pagedllm.worker.runner_output import RunnerOutput


class ModelExecutor(Protocol):
    """The device side of an engine: a loaded model, its limits and KV cache, and its steps.

    Invariants after construction: ``num_kv_blocks`` blocks of the engine's block size are allocated
    (0 for a model that keeps no KV cache); block ids the scheduler hands to :meth:`launch` index them;
    ``max_num_batched_tokens`` and ``max_model_len`` are final.
    """

    # -- the model and its limits -----------------------------------------------------------------
    @property
    def tokenizer(self) -> Any: ...

    @property
    def model_name(self) -> str: ...

    @property
    def model_config(self) -> ModelConfig | BertConfig: ...

    @property
    def checkpoint_path(self) -> str:
        """The checkpoint's folder or file (a folder may hold a pooling configuration)."""
        ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def max_num_batched_tokens(self) -> int: ...

    @property
    def matryoshka_dimensions(self) -> tuple[int, ...] | None:
        """The embedding sizes the model may be truncated to (None: not stated by the model)."""
        ...

    # -- the device -------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def attention_backend(self) -> str: ...

    @property
    def load_time_s(self) -> float: ...

    @property
    def runner(self) -> ModelRunner:
        """The paged model runner (ValueError where the executor has none: an encoder)."""
        ...

    @property
    def lora(self) -> LoRAWorker | None:
        """The LoRA adapters' slots and registry (None: adapters are off)."""
        ...

    # -- the KV cache -----------------------------------------------------------------------------
    @property
    def num_kv_blocks(self) -> int: ...

    @property
    def kv_cache_bytes(self) -> int: ...

    @property
    def num_host_kv_blocks(self) -> int:
        """Blocks of the host tier (``swap_space``); 0 where there is none."""
        ...

    @property
    def preemption_costs(self) -> PreemptionCosts | None:
        """The measured figures ``auto`` preemption weighs (None without a host tier)."""
        ...

    def copy_blocks(self, scheduler_output: SchedulerOutput) -> None:
        """Make the step's block copies between the device's KV cache and the host tier."""
        ...

    # -- steps ------------------------------------------------------------------------------------
    def interleave_steps(self) -> int:
        """Let steps launched back to back run at once on pipeline stages; returns the number of
        stages (1: steps run one after another)."""
        ...

    def release_idle_memory(self) -> None:
        """The engine has nothing left to run: give host memory that was freed back to the OS
        (best effort; the next steps fault their activations in again)."""
        ...

    def launch(self, scheduler_output: SchedulerOutput, times: StepPhaseTimes) -> RunnerOutput:
        """Launch a generation step's forward and sampling (its block copies made first)."""
        ...

    def pool(
        self, scheduler_output: SchedulerOutput, pooling_type: str, times: StepPhaseTimes
    ) -> torch.Tensor:
        """The pooled final hidden states of the scheduled prompts, each computed whole."""
        ...

    def shutdown(self) -> None:
        """Release what the executor started (other ranks); safe to call more than once."""
        ...
