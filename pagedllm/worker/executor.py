"""The executor: everything the engine needs from the device side, behind one object.

:class:`Executor` loads the checkpoint, resolves the device, dtype and attention backend, builds the
:class:`~pagedllm.worker.model_runner.ModelRunner`, sizes and allocates the paged KV cache, and
prepares the fast decode path (CUDA graphs on a GPU, the native decode layers on a CPU). The engine
asks it to :meth:`launch` scheduled steps and nothing else. This executor runs one worker in the
engine's own process; executors that run workers in other processes (tensor and pipeline parallel)
derive from it. Every executor implements :class:`~pagedllm.worker.executor_protocol.ModelExecutor`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from pagedllm.attention.selector import choose_attention_backend
from pagedllm.config import EngineConfig
from pagedllm.lora.registry import LoRAConfig
from pagedllm.model.config import ModelConfig
from pagedllm.model.loader import LoadedCheckpoint, load_checkpoint
from pagedllm.model.quantization import check_before_loading, settle_weights
from pagedllm.model.tokenizer import with_chat_template
from pagedllm.sched.preemption import PreemptionCosts
from pagedllm.sched.scheduler import SchedulerOutput
from pagedllm.worker.cpu_memory import anonymous_resident_bytes, trim_freed_memory, weight_memory
from pagedllm.worker.cpu_threads import ThreadGovernor
from pagedllm.worker.cuda_graphs import graph_memory_estimate
from pagedllm.worker.devices import resolve_device, resolve_dtype
from pagedllm.worker.lora_steps import LoRAWorker
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.phase_times import StepPhaseTimes
from pagedllm.worker.runner_output import RunnerOutput
from pagedllm.worker.swap import HostKVCache, forward_parameters, measure_costs

logger = logging.getLogger("pagedllm")

# KV cache of a CPU engine when neither num_kv_blocks nor kv_cache_memory_bytes is given (at most).
CPU_DEFAULT_KV_BYTES = 1 << 30


class Executor:
    """One in-process worker: the model runner and its KV cache tensors.

    After construction the KV cache holds ``num_kv_blocks`` blocks of ``config.block_size`` tokens;
    block ids handed to :meth:`launch` (through the scheduler's block tables) index it.
    """

    # Whether this executor sizes its CPU threads to the free cores (``config.adapt_cpu_threads``):
    # executors whose steps run on other processes' ranks keep theirs fixed.
    adapts_cpu_threads = True

    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        anon_before = anonymous_resident_bytes()
        self.device = self._resolve_device(config)
        self.dtype = resolve_dtype(config.dtype, self.device)
        check_before_loading(config.quantization, self.device, self.dtype)
        ckpt = self._load_checkpoint(config)
        weights = settle_weights(config.quantization, ckpt.weights, ckpt.path, self.device, self.dtype)
        self.config = config
        self.tokenizer = with_chat_template(ckpt.tokenizer, config.chat_template)
        self.model_config = ckpt.config
        self.model_name = config.served_names(ckpt.name)[0]
        model_max = ckpt.config.scaled_context_length()
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ValueError(
                f"max_model_len {config.max_model_len} is larger than the model's limit of {model_max} tokens."
            )
        self.max_model_len = config.max_model_len or model_max
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(4096, config.max_num_seqs)
        self.checkpoint_path = ckpt.path
        if config.task == "embed":
            # A prompt is pooled whole, in one step (see :meth:`pool`).
            self.max_num_batched_tokens = config.max_num_batched_tokens or max(
                self.max_num_batched_tokens, self.max_model_len
            )
            if self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_model_len "
                    f"({self.max_model_len}) for task embed: a prompt is pooled whole, in one step."
                )
        self.attention_backend = choose_attention_backend(config.attention_backend, self.device, self.dtype)
        torch.manual_seed(config.seed)
        self.runner = self._make_runner(
            ckpt.config,
            weights,
            max_model_len=self.max_model_len,
            block_size=config.block_size,
            device=self.device,
            dtype=self.dtype,
            attention_backend=self.attention_backend,
            max_num_seqs=config.max_num_seqs,
            quantization=config.quantization,
        )
        del ckpt, weights
        self.lora: LoRAWorker | None = None
        if config.enable_lora:
            self.lora = self.runner.enable_lora(
                LoRAConfig(config.max_loras, config.max_lora_rank, config.max_cpu_loras)
            )
            logger.info(
                "LoRA: %d adapter slot(s) of rank up to %d (%.1f MiB); CUDA graphs are off with adapters.",
                config.max_loras,
                config.max_lora_rank,
                self.lora.slot_bytes / 2**20,
            )
        self.num_kv_blocks = self._agree_kv_blocks(self._num_kv_blocks())
        self.runner.allocate_kv_cache(self.num_kv_blocks)
        if self.device.type == "cpu":
            self._log_cpu_memory(anon_before)
        # The host tier (``swap_space`` GiB of blocks laid out as the device's), with the figures
        # ``auto`` preemption weighs, measured here.
        self.host_kv: HostKVCache | None = None
        self.preemption_costs: PreemptionCosts | None = None
        num_host = int(config.swap_space * 2**30) // self.runner.kv_bytes_per_block
        if num_host:
            assert self.runner.kv_cache is not None
            self.host_kv = HostKVCache(self.runner.kv_cache, num_host)
            self.preemption_costs = measure_costs(
                self.model_config, self.runner.kv_cache, self.host_kv, forward_parameters(self.model_config)
            )
        if self.device.type == "cuda" and not config.enforce_eager and self.lora is None:
            self.runner.capture_cuda_graphs(config.max_num_seqs)
        elif self.device.type == "cpu" and not config.enforce_eager:
            self.runner.enable_native_decode()
        self.thread_governor: ThreadGovernor | None = None
        if self.device.type == "cpu" and config.adapt_cpu_threads and self.adapts_cpu_threads:
            self.thread_governor = ThreadGovernor(torch.get_num_threads())
        self.load_time_s = time.perf_counter() - started

    def _log_cpu_memory(self, anon_before: int | None) -> None:
        """Log the weights' bytes (mapped from the file, copied), the KV cache's and the rest: the
        resident anonymous memory start-up added, less the copied weights (the KV cache is not yet
        touched: it becomes resident as it fills)."""
        weights = weight_memory(self.runner.model)
        anon_after = anonymous_resident_bytes()
        other = (
            "?"
            if anon_before is None or anon_after is None
            else f"{(anon_after - anon_before - weights.copied) / 2**20:.0f}"
        )
        logger.info(
            "CPU memory: weights %.0f MiB (%.0f MiB mapped from the checkpoint file, %.0f MiB copied), "
            "KV cache %.0f MiB, other %s MiB",
            weights.total / 2**20,
            weights.mapped / 2**20,
            weights.copied / 2**20,
            self.kv_cache_bytes / 2**20,
            other,
        )

    # Hooks of executors whose ranks each hold a shard (pagedllm.worker.parallel_executor).
    def _resolve_device(self, config: EngineConfig) -> torch.device:
        return resolve_device(config.device)

    def _load_checkpoint(self, config: EngineConfig) -> LoadedCheckpoint:
        return load_checkpoint(config.model, config.tokenizer, keep_quantized=config.quantization != "none")

    def _make_runner(self, model_config: ModelConfig, weights: dict[str, Any], **kwargs: Any) -> ModelRunner:
        return ModelRunner(model_config, weights, **kwargs)

    def _agree_kv_blocks(self, num_blocks: int) -> int:
        """The KV block count every rank uses (here: this one's)."""
        return num_blocks

    def shutdown(self) -> None:
        """Release what the executor started (nothing for one in-process worker)."""

    def interleave_steps(self) -> int:
        """Let steps launched back to back run at once on the executor's pipeline stages, each
        stage on a different step; returns the number of stages (1: steps run one after another)."""
        return 1

    def release_idle_memory(self) -> None:
        if self.device.type == "cpu":
            trim_freed_memory()

    def launch(self, scheduler_output: SchedulerOutput, times: StepPhaseTimes) -> RunnerOutput:
        """Launch a step's forward and sampling: the rows that sample, their tokens (on the device)
        and the step's prompt logprobs. The step's block copies between the tiers are made first."""
        if self.thread_governor is not None:
            self.thread_governor.before_step()
        self.copy_blocks(scheduler_output)
        return self.runner.launch(scheduler_output, times)

    def copy_blocks(self, scheduler_output: SchedulerOutput) -> None:
        """Make the step's block copies between the device's KV cache and the host tier."""
        out, into = scheduler_output.copies_out, scheduler_output.copies_in
        if out or into:
            assert self.host_kv is not None and self.runner.kv_cache is not None
            self.host_kv.copy(self.runner.kv_cache, out, into)

    def pool(
        self, scheduler_output: SchedulerOutput, pooling_type: str, times: StepPhaseTimes
    ) -> torch.Tensor:
        """The pooled final hidden states of the scheduled prompts (see :meth:`ModelRunner.pool`)."""
        if self.thread_governor is not None:
            self.thread_governor.before_step()
        return self.runner.pool(scheduler_output, pooling_type, times)

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_kv_blocks * self.runner.kv_bytes_per_block

    @property
    def num_host_kv_blocks(self) -> int:
        """Blocks of the host tier (0: ``swap_space`` is 0)."""
        return self.host_kv.num_blocks if self.host_kv is not None else 0

    @property
    def matryoshka_dimensions(self) -> tuple[int, ...] | None:
        """A decoder states no truncation sizes of its own (a pooling configuration may)."""
        return None

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = self.runner.kv_bytes_per_block
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            # Enough for max_num_seqs full-length sequences, capped at CPU_DEFAULT_KV_BYTES.
            blocks_needed = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)
            budget = min(CPU_DEFAULT_KV_BYTES, blocks_needed * per_block)
        num = budget // per_block
        if num < 1:
            raise ValueError(f"not enough memory for a single KV block ({per_block} bytes).")
        return int(num)

    def _cuda_kv_budget(self) -> int:
        """KV cache bytes on a GPU, after profiling a forward at ``max_num_batched_tokens``.

        ``gpu_memory_utilization`` of the device's memory, less the profiled peak of torch's allocator
        (weights and activations), less what is held outside it (the CUDA context, other processes),
        less a margin for the decode CUDA graphs.
        """
        cfg = self.config
        max_tokens = self.max_num_batched_tokens
        peak = self.runner.profile_peak_memory(max_tokens, cfg.max_num_seqs)
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = max(0, total - free - torch.cuda.memory_reserved(self.device))
        graphs = 0
        if not cfg.enforce_eager and self.runner.backend.supports_graph_capture:
            graphs = graph_memory_estimate(self.model_config, cfg.max_num_seqs, self.runner.dtype)
        budget = int(total * cfg.gpu_memory_utilization) - peak - non_torch - graphs
        per_block = self.runner.kv_bytes_per_block
        logger.info(
            "GPU memory: %.2f GiB total x %.2f utilization; peak of a %d-token forward %.2f GiB (weights "
            "%.2f GiB), outside torch %.2f GiB, CUDA graph margin %.2f GiB -> KV cache %.2f GiB = %d blocks",
            total / 2**30,
            cfg.gpu_memory_utilization,
            max_tokens,
            peak / 2**30,
            torch.cuda.memory_allocated(self.device) / 2**30,
            non_torch / 2**30,
            graphs / 2**30,
            max(budget, 0) / 2**30,
            max(budget, 0) // per_block,
        )
        return budget
