"""The interface every attention backend implements, and the batch metadata it reads.

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

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = do not write (padding)
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, total context length per request (incl. new tokens)
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host-side copies, so backends never need a device sync to read them.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


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


def get_attention_backend(name: str) -> AttentionBackend:
    if name == "torch":
        from pagedllm.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "cpu":
        from pagedllm.attention.cpu_backend import CPUAttentionBackend

        return CPUAttentionBackend()
    if name == "triton":
        from pagedllm.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"attention_backend must be 'torch', 'cpu' or 'triton', got {name!r}.")


def choose_attention_backend(requested: str | None, device: torch.device, dtype: torch.dtype) -> str:
    """The backend to use: ``requested``, checked, or the best available when it is None.

    Default: ``"triton"`` on CUDA; on the CPU ``"cpu"`` for float32 models when its native kernel
    builds (see :mod:`pagedllm.native`), else ``"torch"``.
    """
    if requested == "cpu":
        from pagedllm.native import load_library

        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError("attention_backend 'cpu' needs device 'cpu' and dtype float32.")
        load_library()  # raises with the compiler's message
        return requested
    if requested is not None:
        return requested
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu" and dtype == torch.float32:
        from pagedllm.native import kernels_available

        if kernels_available():
            return "cpu"
    return "torch"
