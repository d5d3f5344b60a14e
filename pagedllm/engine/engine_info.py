"""What a front-end knows of the engine it serves: :class:`EngineInfo`, the same whether the engine
runs on a thread of the front-end's process or in core processes of its own (which report it in
their ``Hello`` message, so it is a msgspec struct)."""

from __future__ import annotations

import msgspec

from pagedllm.model.pooling import PoolingConfig


class EngineInfo(msgspec.Struct, array_like=True):
    """What a front-end knows of the engine it serves, and all it knows (the same for every core;
    the front-end's tokenizer is its own): the model, its task and generation defaults, and the
    engine's limits. A core reports it in :class:`Hello`; an engine in the front-end's process is
    described by :func:`~pagedllm.engine.engine_core.engine_info`."""

    model_name: str
    task: str  # "generate" or "embed"
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    default_sampling: dict[str, float | int]  # the model's generation-config defaults
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    max_logprobs: int
    enable_prefix_caching: bool
    # Pooling of an embed engine: (type, normalize, hidden size, matryoshka sizes or None).
    pooling: tuple[str, bool, int, tuple[int, ...] | None] | None = None
    scheduling_policy: str = "fcfs"  # "fcfs" or "priority" (requests' priorities are taken)
    max_num_batched_tokens: int = 0  # a step's token budget (0: not reported)

    @property
    def pooling_config(self) -> PoolingConfig | None:
        """The pooling of an embed engine (None for a generating one)."""
        return PoolingConfig(*self.pooling) if self.pooling is not None else None


__all__ = ["EngineInfo"]
