"""The paged KV cache tensors: per layer, K and V of shape [num_blocks, block_size, kv_heads, head_dim]."""

from __future__ import annotations

import torch

from pagedllm.worker.cpu_memory import advise_huge_pages


class KVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.storage = torch.empty(shape, dtype=dtype, device=device)
        advise_huge_pages(self.storage)  # before the first touch; a no-op off Linux/CPU
        self.storage.zero_()
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self.storage[0, i], self.storage[1, i]) for i in range(num_layers)
        ]

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()
