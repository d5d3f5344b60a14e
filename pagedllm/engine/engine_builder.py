"""Building an engine: the configuration resolved and checked, and the parts an
:class:`~pagedllm.engine.llm_engine.LLMEngine` runs on made, in an order that fails fast.

:func:`build_engine_parts` is the one place that decides, from an :class:`EngineConfig` and the model:

1. the generation defaults (``--generation-config``), read before any weight loads;
2. the task (:func:`resolve_task`: an encoder embeds) and what it rules out (pooling options of a
   generating engine, ``async_scheduling`` or ``swap_space`` of an embedding one), and speculative
   decoding (:func:`check_speculative`), before any rank process starts;
3. the executor (:func:`choose_executor`): tensor/pipeline parallel, an encoder's, or in-process;
4. the draft proposer, scheduling ahead and the steps left in flight (pipeline stages);
5. the input processor; for task ``embed`` the pooling configuration, the prefix-caching decision
   (only last-token pooling of a decoder can reuse a cached prefix) and the pooling processor;
6. the KV cache manager (with the executor's host tier), the scheduler's configuration (whole
   prompts for embeddings, the step-time budget) and the scheduler, and the output processor.

Everything else is an :class:`EngineParts` field; the engine only runs them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from pagedllm.config import EngineConfig
from pagedllm.engine.engine_checks import check_speculative, resolve_step_time
from pagedllm.engine.engine_tasks import EngineTask, GenerateTask, PoolingTask, injected_fault_step
from pagedllm.engine.input_processor import InputLimits, InputProcessor
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.pooling_processor import PoolingLimits, PoolingProcessor, resolve_task
from pagedllm.model.generation_config import load_generation_defaults
from pagedllm.model.pooling import PoolingConfig, resolve_pooling_config
from pagedllm.sched.kv_cache_manager import KVCacheManager, uniform_sliding_window
from pagedllm.sched.scheduler import Scheduler, SchedulerConfig
from pagedllm.spec.config import SpeculativeConfig
from pagedllm.spec.proposer import NgramProposer, Proposer
from pagedllm.worker.draft_model import DraftModelProposer
from pagedllm.worker.encoder_executor import EncoderExecutor, is_encoder_model
from pagedllm.worker.executor import Executor
from pagedllm.worker.executor_protocol import ModelExecutor

logger = logging.getLogger("pagedllm")


@dataclass
class EngineParts:
    """What an engine runs on, built and checked by :func:`build_engine_parts`.

    ``task`` holds the requests (:mod:`pagedllm.engine.engine_tasks`); ``scheduler`` schedules over
    ``kv_cache_manager``'s blocks, which ``executor`` holds. ``max_in_flight`` is the number of
    steps left in flight when a step returns (at least 1; more only over pipeline stages).
    ``pooling_config`` is set for task ``embed`` only.
    """

    config: EngineConfig
    default_sampling: dict[str, float | int]
    task: EngineTask
    executor: ModelExecutor
    speculative: SpeculativeConfig | None
    proposer: Proposer | None
    async_scheduling: bool
    max_in_flight: int
    input_processor: InputProcessor
    output_processor: OutputProcessor
    kv_cache_manager: KVCacheManager
    scheduler: Scheduler
    pooling_config: PoolingConfig | None
    fault_at_step: int


def check_task_options(config: EngineConfig, task: str) -> None:
    """Refuse options that do not apply to the engine's task (ValueError naming the field)."""
    if task != "embed" and (config.pooling_type is not None or config.pooling_normalize is not None):
        raise ValueError("pooling_type and pooling_normalize apply to task 'embed' only.")


def check_embed_options(config: EngineConfig, task: str) -> None:
    """Refuse options of generation in an embedding engine (ValueError naming the field)."""
    if task == "embed" and (config.async_scheduling or config.swap_space):
        raise ValueError(
            f"{'async_scheduling' if config.async_scheduling else 'swap_space'} does not apply to task "
            "embed: a prompt is computed and pooled in one step."
        )


def choose_executor(config: EngineConfig, encoder: bool) -> ModelExecutor:
    """The executor the configuration asks for, built (the model loaded, the KV cache allocated):
    a :class:`ParallelExecutor` over more than one rank (node 0 only; not for encoders), an
    :class:`EncoderExecutor` for an encoder, else the in-process :class:`Executor`."""
    if config.world_size > 1 or config.nnodes > 1:
        if encoder or config.node_rank:
            raise ValueError(
                "tensor_parallel_size / pipeline_parallel_size: encoder models run on one rank."
                if encoder
                else f"node_rank {config.node_rank}: only node 0 runs the engine (start the others "
                "with `pagedllm serve --node-rank N`)."
            )
        from pagedllm.worker.parallel_executor import ParallelExecutor

        return ParallelExecutor(config)
    return EncoderExecutor(config) if encoder else Executor(config)


def make_proposer(
    spec: SpeculativeConfig | None, config: EngineConfig, executor: ModelExecutor
) -> Proposer | None:
    """Prompt lookup, or a draft model loaded next to the target (its own KV cache); None: off."""
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec, executor.max_model_len)
    return DraftModelProposer(spec, config, executor)


def resolve_async_scheduling(
    config: EngineConfig, task: str, device_type: str, proposer: Proposer | None
) -> bool:
    """Whether steps are scheduled ahead: ``async_scheduling`` where set, else on where it pays (a GPU
    computes while the host schedules, and pipeline stages work on different steps), never with
    speculative decoding (drafts follow the latest token) and only for task ``generate``."""
    if config.async_scheduling is not None:
        wanted = config.async_scheduling
    else:
        wanted = (device_type == "cuda" or config.pipeline_parallel_size > 1) and proposer is None
    return wanted and task == "generate"


def resolve_prefix_caching(config: EngineConfig, encoder: bool, pooling: PoolingConfig | None) -> bool:
    """Prefix caching as asked, except where pooling needs every row: only the last token's state
    survives a cached prefix, so mean and CLS pooling (and encoders) compute every prompt whole."""
    if pooling is None:
        return config.enable_prefix_caching
    return config.enable_prefix_caching and not encoder and pooling.pooling_type == "last"


def build_engine_parts(config: EngineConfig) -> EngineParts:
    """Resolve ``config`` and build every part of an engine (see the module docstring); ValueError
    naming the field where the configuration cannot run, before the weights load where it can be."""
    # Read (and checked) before the weights load, so a bad --generation-config fails fast. The
    # model's default sampling parameters found (a subset of temperature, top_p, top_k, min_p,
    # repetition_penalty); a request's own values win over them.
    default_sampling: dict[str, float | int] = dict(
        load_generation_defaults(config.generation_config, config.model).values
    )
    encoder = is_encoder_model(config.model)
    task = resolve_task(config.task, encoder, config.model or "the default model")
    check_task_options(config, task)
    speculative = check_speculative(config, task)  # before any rank process starts
    check_embed_options(config, task)
    executor = choose_executor(config, encoder)
    proposer = make_proposer(speculative, config, executor)
    if speculative is not None:
        logger.info(
            "Speculative decoding: %s; scheduling ahead is off with it, and steps that verify drafts "
            "run without CUDA graphs.",
            speculative,
        )
    async_scheduling = resolve_async_scheduling(config, task, executor.device.type, proposer)
    # Steps launched back to back that the executor's pipeline stages run at once (1: none).
    interleaved = executor.interleave_steps() if async_scheduling else 1
    num_blocks = executor.num_kv_blocks
    tokenizer = executor.tokenizer
    eos_token_ids = list(executor.model_config.eos_token_ids)
    input_processor = InputProcessor(
        tokenizer,
        eos_token_ids,
        InputLimits(
            vocab_size=executor.model_config.vocab_size,
            max_model_len=executor.max_model_len,
            max_logprobs=config.max_logprobs,
            block_size=config.block_size,
            num_kv_blocks=num_blocks,
            max_num_seqs=config.max_num_seqs,
        ),
        lora_registry=executor.lora.registry if executor.lora is not None else None,
    )
    pooling_config: PoolingConfig | None = None
    if task == "embed":
        path = executor.checkpoint_path  # a folder may hold a sentence-transformers pooling config
        pooling_config = resolve_pooling_config(
            path if os.path.isdir(path) else None,
            encoder=encoder,
            hidden_size=executor.model_config.hidden_size,
            matryoshka_dimensions=executor.matryoshka_dimensions,
            pooling_type=config.pooling_type,
            normalize=config.pooling_normalize,
        )
    kv_cache_manager = KVCacheManager(
        num_blocks,
        config.block_size,
        resolve_prefix_caching(config, encoder, pooling_config),
        sliding_window=uniform_sliding_window(executor.model_config),
        num_host_blocks=executor.num_host_kv_blocks,
    )
    scheduler = Scheduler(
        SchedulerConfig(
            config.max_num_seqs,
            executor.max_num_batched_tokens,
            whole_prompts=task == "embed",
            uses_kv_cache=not encoder,
            interleaved_steps=interleaved,
            policy=config.scheduling_policy,
            preemption_mode=config.preemption_mode,
            costs=executor.preemption_costs,
            max_step_time_s=resolve_step_time(config, task, executor.device.type, interleaved),
            max_loras=config.max_loras if config.enable_lora else 0,
        ),
        kv_cache_manager,
    )
    output_processor = OutputProcessor(tokenizer, executor.max_model_len)
    fault_at_step = injected_fault_step()
    engine_task: EngineTask
    if pooling_config is not None:
        pooling = PoolingProcessor(
            input_processor,
            pooling_config,
            PoolingLimits(executor.max_model_len, config.block_size, None if encoder else num_blocks),
        )
        engine_task = PoolingTask(executor.model_name, encoder, scheduler, pooling, fault_at_step)
    else:
        engine_task = GenerateTask(executor.model_name, scheduler, input_processor, output_processor)
    return EngineParts(
        config=config,
        default_sampling=default_sampling,
        task=engine_task,
        executor=executor,
        speculative=speculative,
        proposer=proposer,
        async_scheduling=async_scheduling,
        max_in_flight=max(1, interleaved - 1),
        input_processor=input_processor,
        output_processor=output_processor,
        kv_cache_manager=kv_cache_manager,
        scheduler=scheduler,
        pooling_config=pooling_config,
        fault_at_step=fault_at_step,
    )


def log_engine_parts(parts: EngineParts) -> None:
    """The start-up summary: the model, device and KV cache, concurrency, and the host tier."""
    executor, config = parts.executor, parts.config
    num_blocks = executor.num_kv_blocks
    tokens = num_blocks * config.block_size
    max_model_len = executor.max_model_len
    logger.info(
        "Loaded %s on %s (%s, %s attention) in %.1fs. KV cache: %d blocks x %d tokens = %d tokens "
        "(%.0f MiB); maximum concurrency for %d-token requests: %.2fx; scheduling ahead %s; task %s",
        executor.model_name,
        executor.device,
        str(executor.dtype).removeprefix("torch."),
        executor.attention_backend,
        executor.load_time_s,
        num_blocks,
        config.block_size,
        tokens,
        executor.kv_cache_bytes / 2**20,
        max_model_len,
        tokens / max_model_len,
        "on" if parts.async_scheduling else "off",
        parts.task.name,
    )
    host, costs = parts.kv_cache_manager.host, parts.scheduler.config.costs
    if host is not None and costs is not None:
        logger.info(
            "Host KV tier: %d blocks (%.0f MiB); preemption %s; measured copies %.2f GB/s, products "
            "%.1f GFLOP/s",
            host.pool.num_blocks,
            host.pool.num_blocks * costs.block_bytes / 2**20,
            config.preemption_mode,
            costs.copy_bytes_per_s / 1e9,
            costs.flops_per_s / 1e9,
        )
