"""All decoder layers of a Llama-family decode step in one native call (``llama_decode_layers_f32`` in
``pagedllm/kernels/csrc/decode_layers_cpu.c``).

:class:`DecodeLayersKernel` holds pointers to every layer's weights (norms, panel-layout projections,
an optional q/k/v bias) and KV caches, in the field-major order the C side indexes them; the tensors
must stay alive and in place while it is used. The model-specific part (which module holds which
weight, and when a model qualifies) is :mod:`pagedllm.model.cpu_decode`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pagedllm.kernels.cpu.library import load_library


@dataclass
class DecodeLayerTensors:
    """One decoder layer's tensors, float32 and contiguous (panels from :mod:`~pagedllm.kernels.cpu.linear`)."""

    input_norm: torch.Tensor  # [hidden]
    qkv_panels: torch.Tensor
    qkv_bias: torch.Tensor | None  # [q + 2 kv] or None
    o_panels: torch.Tensor
    post_attention_norm: torch.Tensor  # [hidden]
    gate_up_panels: torch.Tensor
    down_panels: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor


@dataclass(frozen=True)
class DecodeShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    eps: float  # RMSNorm epsilon
    scale: float  # attention softmax scale
    block_size: int


class DecodeLayersKernel:
    """Runs every layer and the final norm over decode rows (one query token each)."""

    def __init__(
        self, layers: list[DecodeLayerTensors], final_norm: torch.Tensor, shape: DecodeShape
    ) -> None:
        def ptr(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            if not t.is_contiguous():
                raise ValueError("native decode needs contiguous weights and caches.")
            return t.data_ptr()

        names = [
            "input_norm",
            "qkv_panels",
            "qkv_bias",
            "o_panels",
            "post_attention_norm",
            "gate_up_panels",
            "down_panels",
            "k_cache",
            "v_cache",
        ]
        flat = [ptr(getattr(layer, name)) for name in names for layer in layers]  # field-major
        self._layer_ptrs = (ctypes.c_void_p * len(flat))(*flat)
        self._layers = layers  # keeps the tensors alive
        self._final_norm = final_norm
        self.num_layers = len(layers)
        self.shape = shape

    def __call__(
        self,
        x: torch.Tensor,  # [rows, hidden] float32 embeddings
        positions: torch.Tensor,
        cos_cache: torch.Tensor,
        sin_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
    ) -> torch.Tensor:
        """Hidden states after the final norm, one row per decode row."""
        s = self.shape
        rows = x.shape[0]
        out = torch.empty(rows, s.hidden, dtype=torch.float32)
        if rows == 0:
            return out
        if not (cos_cache.is_contiguous() and sin_cache.is_contiguous()) or cos_cache.dtype != torch.float32:
            raise ValueError("rotary tables must be contiguous float32.")
        # Held in locals so that any converted copy outlives the call.
        x = x.contiguous()
        positions = positions.to(torch.int64).contiguous()
        slots = slot_mapping.to(torch.int64).contiguous()
        tables = block_tables.contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        rc = load_library().llama_decode_layers_f32(
            self.num_layers, self._layer_ptrs, self._final_norm.data_ptr(),
            x.data_ptr(), out.data_ptr(), rows, s.hidden, s.num_heads, s.num_kv_heads,
            s.head_dim, s.intermediate, s.eps, s.scale,
            positions.data_ptr(), cos_cache.data_ptr(), sin_cache.data_ptr(),
            slots.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
            max_seq_len, s.block_size,
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("native decode layers: out of memory for scratch buffers.")
        return out
