"""The executor of an encoder-only model (BERT): no paged KV cache, one forward per prompt.

An encoder reads its whole prompt at once (attention is bidirectional), so a prompt is never split
across steps and nothing of it is kept after its step: the engine schedules such prompts whole, under
the same ``max_num_seqs`` and ``max_num_batched_tokens`` budgets as generation, with a KV pool of zero
blocks. This executor implements :class:`~pagedllm.worker.executor_protocol.ModelExecutor` as an
encoder honestly can: :meth:`pool` runs its steps; it has no host tier, no pipeline stages and no
paged model runner, and :meth:`launch` refuses (it does not generate).
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from pagedllm.config import EngineConfig
from pagedllm.kernels.cpu.linear import optimize_cpu_linears
from pagedllm.model.bert import (
    BertEncoder,
    is_bert_checkpoint,
    load_bert_config,
    load_bert_weights,
    max_seq_length,
)
from pagedllm.model.empty_init import empty_modules, to_empty
from pagedllm.model.loader import resolve_model_path
from pagedllm.model.pooling import pool_hidden
from pagedllm.model.tokenizer import load_tokenizer, with_chat_template
from pagedllm.sched.preemption import PreemptionCosts
from pagedllm.sched.scheduler import SchedulerOutput
from pagedllm.worker.cpu_memory import keep_freed_memory, trim_freed_memory
from pagedllm.worker.devices import resolve_device, resolve_dtype, to_device
from pagedllm.worker.lora_steps import LoRAWorker
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.phase_times import StepPhaseTimes
from pagedllm.worker.runner_output import RunnerOutput

logger = logging.getLogger("pagedllm")

# Engine arguments that size or shape a paged KV cache or a decoder's weights: an encoder has none of
# those, so setting one is an error rather than silently ignored.
_DECODER_ONLY_ARGS = ("num_kv_blocks", "kv_cache_memory_bytes", "attention_backend")


def is_encoder_model(model: str | None) -> bool:
    """Whether the model argument names an encoder checkpoint (a BERT folder), which embeds only."""
    if model is None:
        return False
    kind, path = resolve_model_path(model)
    return kind == "hf" and is_bert_checkpoint(path)


class EncoderExecutor:
    """Loads a BERT folder and pools scheduled prompts with it (float32 on the CPU by default).

    ``num_kv_blocks`` is 0. ``max_num_batched_tokens`` is at least ``max_model_len`` (a prompt runs
    whole in one step); a smaller explicit value is an error.
    """

    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        for name in _DECODER_ONLY_ARGS:
            if getattr(config, name) is not None:
                raise ValueError(f"{name} does not apply to an encoder model, which keeps no KV cache.")
        if config.quantization not in ("auto", "none"):
            raise ValueError(f"quantization {config.quantization!r} is not supported for encoder models.")
        if config.async_scheduling:
            raise ValueError("async_scheduling does not apply to embeddings: a step's outputs are its own.")
        kind, path = resolve_model_path(config.model)
        if kind != "hf" or not is_bert_checkpoint(path):
            raise ValueError(f"{config.model!r} is not a BERT model folder.")
        self.config = config
        self.checkpoint_path = path
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_config = load_bert_config(path)
        weights = load_bert_weights(path, self.model_config)
        tokenizer = load_tokenizer(config.tokenizer if config.tokenizer is not None else path)
        self.tokenizer = with_chat_template(tokenizer, config.chat_template)
        self.model_name = config.served_names(os.path.basename(os.path.normpath(path)))[0]
        model_max = max_seq_length(path, self.model_config)
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ValueError(
                f"max_model_len {config.max_model_len} is larger than the model's limit of {model_max} tokens."
            )
        self.max_model_len = config.max_model_len or model_max
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(
            4096, config.max_num_seqs, self.max_model_len
        )
        if self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_model_len "
                f"({self.max_model_len}) for an encoder: a prompt is encoded whole, in one step."
            )
        with empty_modules():
            model = BertEncoder(self.model_config)
        model = to_empty(model, "cpu")
        model.load_weights(weights)
        del weights
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.attention_backend = "sdpa"
        if self.device.type == "cpu":
            logger.info("CPU linear layers: %s weights", optimize_cpu_linears(self.model))
            keep_freed_memory()
        self.num_kv_blocks = 0
        self.kv_cache_bytes = 0
        self.load_time_s = time.perf_counter() - started

    # -- what an encoder does not have (see ModelExecutor) ----------------------------------------
    num_host_kv_blocks = 0  # no host tier: nothing is kept between steps
    preemption_costs: PreemptionCosts | None = None
    lora: LoRAWorker | None = None  # adapters apply to generation only

    @property
    def matryoshka_dimensions(self) -> tuple[int, ...] | None:
        return self.model_config.matryoshka_dimensions

    @property
    def runner(self) -> ModelRunner:
        raise ValueError(f"{self.model_name} is an encoder: it has no paged model runner.")

    def interleave_steps(self) -> int:
        return 1

    def copy_blocks(self, scheduler_output: SchedulerOutput) -> None:
        if scheduler_output.copies_out or scheduler_output.copies_in:
            raise ValueError(f"{self.model_name} is an encoder: it keeps no KV blocks to copy.")

    def shutdown(self) -> None:
        """Nothing to stop: the encoder runs in the engine's process."""

    def release_idle_memory(self) -> None:
        if self.device.type == "cpu":
            trim_freed_memory()

    def launch(self, scheduler_output: SchedulerOutput, times: StepPhaseTimes) -> RunnerOutput:
        """Generation steps: an encoder has none (the engine runs task embed)."""
        raise ValueError(f"{self.model_name} is an encoder: it embeds and does not generate.")

    @torch.inference_mode()
    def pool(
        self, scheduler_output: SchedulerOutput, pooling_type: str, times: StepPhaseTimes
    ) -> torch.Tensor:
        """The pooled final hidden states (``[n, hidden]`` float32, on the host) of the scheduled
        prompts, each computed whole in this step."""
        started = time.perf_counter()
        seqs = [s.request.prompt_token_ids for s in scheduler_output.scheduled_requests]
        for s in scheduler_output.scheduled_requests:
            if s.request.num_computed_tokens or s.num_tokens != s.request.num_tokens:
                raise ValueError(
                    f"request {s.request.request_id}: an encoder runs whole prompts in one step."
                )
        lens = [len(ids) for ids in seqs]
        ids = to_device(torch.from_numpy(np.concatenate(seqs).astype(np.int64)), self.device)
        positions = to_device(torch.from_numpy(np.concatenate([np.arange(n) for n in lens])), self.device)
        prepared = time.perf_counter()
        times.prepare += prepared - started
        hidden = self.model(ids, positions, lens)
        pooled = pool_hidden(hidden, lens, pooling_type).cpu()
        times.forward += time.perf_counter() - prepared
        return pooled
