"""The interface every attention backend implements, and the batch metadata it reads
(:class:`AttentionMetadata`, defined beside the kernels that read it).

KV cache layout (per layer): ``k_cache`` and ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. Slot ``s`` is block ``s // block_size``,
offset ``s % block_size``.

A batch is a flat list of ``num_tokens`` query tokens from ``B`` requests. Request ``i`` owns query
rows ``query_start_loc[i]:query_start_loc[i+1]`` and has ``seq_lens[i]`` tokens of context in
total, including its new tokens; so its new tokens sit at positions
``seq_lens[i] - query_len_i ... seq_lens[i] - 1`` and attend causally to every earlier position
(cached prefix, earlier chunks, and earlier new tokens). A decode is a request with query_len 1.
The K/V of the new tokens are written at ``slot_mapping`` before attention reads them.
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
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
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
