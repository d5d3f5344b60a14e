"""The interface every attention backend implements.

Backends read a batch described by :class:`AttentionMetadata` (defined beside the kernels in
:mod:`pagedllm.kernels.attention_metadata`, which states the KV cache layout and the flat-batch
layout) and write new K/V at its ``slot_mapping`` before attention reads them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pagedllm.kernels.attention_metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata"]


class AttentionBackend(Protocol):
    """Writes new K/V into the paged cache and computes attention over it."""

    name: str

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Causal attention of every query row over its request's context.

        ``sliding_window``: a query at position p attends only to keys at positions k with
        ``p - sliding_window < k <= p`` (the newest ``sliding_window`` positions, itself included);
        None attends to every earlier position. Blocks wholly before a request's window are never
        read, so their block-table entries may be placeholders.
        ``logits_soft_cap``: scores become ``cap * tanh(score / cap)`` after scaling by ``scale`` and
        before the softmax (Gemma 2); None leaves them as they are.
        """
        ...

    # Whether CUDA graphs can capture this backend's launches (no host syncs, and a launch shape that
    # for_graph_capture can fix for a batch size).
    supports_graph_capture: bool

    def for_graph_capture(
        self,
        query: torch.Tensor,  # [batch_size, num_heads, head_dim], the bucket's shape
        k_cache: torch.Tensor,
        meta: AttentionMetadata,  # the bucket's static metadata, contexts up to meta.max_seq_len
    ) -> AttentionBackend:
        """A backend whose launches for this bucket do not depend on the step's context lengths."""
        ...
