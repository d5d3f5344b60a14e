"""All decoder layers of a Llama-family decode step in one native call (``llama_decode_layers_f32`` in
``pagedllm/kernels/csrc/decode_layers_cpu.c``).

:class:`DecodeLayersKernel` holds pointers to every layer's weights (norms; projections as
:class:`LinearWeightStruct`: float32 panels or GGUF blocks, with an optional bias) and KV caches, in the
field-major order the C side indexes them; the tensors must stay alive and in place while it is used. The model-specific part (which module holds which
weight, and when a model qualifies) is :mod:`pagedllm.model.cpu_decode`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from pagedllm.kernels.cpu.library import load_library
from pagedllm.kernels.cpu.linear import PanelLinear
from pagedllm.kernels.cpu.quant_linear import QuantLinear

_MAX_PARTS = 4  # LINEAR_MAX_PARTS in decode_layers_cpu.c
_PANELS = 0  # LINEAR_PANELS: a part of float32 panels


class LinearWeightStruct(ctypes.Structure):
    """``linear_weight_t`` of ``decode_layers_cpu.c``: a projection's weight as the C loop reads it."""

    _fields_ = [
        ("num_parts", ctypes.c_int64),
        ("type", ctypes.c_int64 * _MAX_PARTS),
        ("rows", ctypes.c_int64 * _MAX_PARTS),
        ("data", ctypes.c_void_p * _MAX_PARTS),
        ("bias", ctypes.c_void_p),
        ("amx_min_rows", ctypes.c_int64 * _MAX_PARTS),
        ("lora_a", ctypes.c_void_p),
        ("lora_b", ctypes.c_void_p),
        ("lora_k", ctypes.c_int64),
        ("lora_ranks", ctypes.c_void_p),
        ("lora_num_subs", ctypes.c_int64),
        ("lora_sub_rows", ctypes.c_int64 * _MAX_PARTS),
    ]


# The most adapter slots and the widest slot (ranks of every sub-projection) the C loop takes.
MAX_LORA_SEGMENTS = 64
MAX_LORA_WIDTH = _MAX_PARTS * 256


class LoRAPlanStruct(ctypes.Structure):
    """``lora_plan_t``: segment ``s`` is rows ``order[start[s]:start[s] + len[s]]`` of slot ``slot[s]``."""

    _fields_ = [
        ("num_segs", ctypes.c_int64),
        ("order", ctypes.c_void_p),
        ("start", ctypes.c_void_p),
        ("len", ctypes.c_void_p),
        ("slot", ctypes.c_void_p),
    ]


@dataclass(frozen=True)
class LoRASlotsView:
    """A projection's adapter slots as the C loop reads them (see ``linear_weight_t``)."""

    a: torch.Tensor  # [slots, in, K] float32, contiguous: each slot's A, input-major
    b: torch.Tensor  # [slots, K, out] float32, contiguous: each slot's B, rank-major
    ranks: torch.Tensor  # [slots] int64: each slot's rank here, 0 for none (kept current by its owner)
    sub_rows: tuple[int, ...]  # the outputs of each sub-projection, stacked


@dataclass(frozen=True)
class LoRAPlan:
    """Which decode rows run which slot, as ``lora_plan_t`` reads it (int64 tensors)."""

    order: torch.Tensor  # the rows, grouped by slot
    start: torch.Tensor  # per segment: its first entry of ``order``
    len: torch.Tensor
    slot: torch.Tensor

    def struct(self) -> LoRAPlanStruct:
        return LoRAPlanStruct(
            len(self.slot),
            self.order.data_ptr(),
            self.start.data_ptr(),
            self.len.data_ptr(),
            self.slot.data_ptr(),
        )


def linear_weight_struct(
    module: PanelLinear | QuantLinear, lora: LoRASlotsView | None = None
) -> LinearWeightStruct:
    """The C description of a panel or quantized linear layer (pointing into its tensors), with its
    adapter slots when ``lora`` is given."""
    if isinstance(module, PanelLinear):
        parts = [(_PANELS, module.out_features, module.panels.data_ptr(), 0)]
    else:
        # amx_min_rows 0: never the AMX tiles. Decode rows take the integer kernels whatever their
        # number (prompt rows, which take the tiles, never run here: see pagedllm.kernels.cpu.row_paths).
        parts = [(p.type_id, p.out_features, p.blocks.data_ptr(), 0) for p in module.parts]
    if len(parts) > _MAX_PARTS:
        raise ValueError(f"native decode takes at most {_MAX_PARTS} parts per projection, got {len(parts)}.")
    bias = module.bias
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError("native decode needs a contiguous float32 bias.")
    desc = LinearWeightStruct()
    desc.num_parts = len(parts)
    for i, (type_id, rows, ptr, amx_rows) in enumerate(parts):
        desc.type[i], desc.rows[i], desc.data[i], desc.amx_min_rows[i] = type_id, rows, ptr, amx_rows
    desc.bias = None if bias is None else bias.data_ptr()
    if lora is not None:
        slots, width = lora.a.shape[0], lora.a.shape[2]
        if not (lora.a.is_contiguous() and lora.b.is_contiguous() and lora.a.dtype == torch.float32):
            raise ValueError("native decode needs contiguous float32 adapter slots.")
        if slots > MAX_LORA_SEGMENTS or width > MAX_LORA_WIDTH or len(lora.sub_rows) > _MAX_PARTS:
            raise ValueError(
                f"native decode takes at most {MAX_LORA_SEGMENTS} slots of width {MAX_LORA_WIDTH}."
            )
        desc.lora_a, desc.lora_b, desc.lora_k = lora.a.data_ptr(), lora.b.data_ptr(), width
        desc.lora_ranks, desc.lora_num_subs = lora.ranks.data_ptr(), len(lora.sub_rows)
        for i, rows in enumerate(lora.sub_rows):
            desc.lora_sub_rows[i] = rows
    return desc


@dataclass
class DecodeLayerTensors:
    """One decoder layer's tensors (norms and caches float32 and contiguous) and projections."""

    input_norm: torch.Tensor  # [hidden]
    qkv: PanelLinear | QuantLinear  # fused q/k/v (its bias, if any, is added)
    o: PanelLinear | QuantLinear
    post_attention_norm: torch.Tensor  # [hidden]
    gate_up: PanelLinear | QuantLinear  # fused gate/up
    down: PanelLinear | QuantLinear
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    # Each projection's adapter slots, by field name ("qkv", "o", "gate_up", "down"); empty: none.
    lora: dict[str, LoRASlotsView] = field(default_factory=dict)


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
    rope_interleaved: bool = False  # rotary pairs (2i, 2i + 1) instead of (i, i + head_dim / 2)


class DecodeLayersKernel:
    """Runs every layer and the final norm over decode rows (one query token each)."""

    def __init__(
        self, layers: list[DecodeLayerTensors], final_norm: torch.Tensor, shape: DecodeShape
    ) -> None:
        self._structs: list[LinearWeightStruct] = []

        def ptr(layer: DecodeLayerTensors, name: str) -> int:
            value = getattr(layer, name)
            if isinstance(value, (PanelLinear, QuantLinear)):
                self._structs.append(linear_weight_struct(value, layer.lora.get(name)))
                return ctypes.addressof(self._structs[-1])
            if not value.is_contiguous():
                raise ValueError("native decode needs contiguous weights and caches.")
            return int(value.data_ptr())

        names = ["input_norm", "qkv", "o", "post_attention_norm", "gate_up", "down", "k_cache", "v_cache"]
        flat = [ptr(layer, name) for name in names for layer in layers]  # field-major
        self._layer_ptrs = (ctypes.c_void_p * len(flat))(*flat)
        self._layers = layers  # keeps the tensors (and the structs' targets) alive
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
        residual: torch.Tensor | None = None,
        final: bool = True,
        lora: LoRAPlan | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(hidden states after the final norm, None)``, one row per decode row; for a pipeline
        stage that starts from ``residual`` (the residual stream carried with ``x``) or is not the
        last (``final`` False: ``(x, residual)`` after the layers, before the final norm)."""
        s = self.shape
        rows = x.shape[0]
        out = torch.empty(rows, s.hidden, dtype=torch.float32)
        residual_out = None if final else torch.empty(rows, s.hidden, dtype=torch.float32)
        if rows == 0:
            return out, residual_out
        residual_in = None if residual is None else residual.contiguous()
        if not (cos_cache.is_contiguous() and sin_cache.is_contiguous()) or cos_cache.dtype != torch.float32:
            raise ValueError("rotary tables must be contiguous float32.")
        # Held in locals so that any converted copy outlives the call.
        x = x.contiguous()
        positions = positions.to(torch.int64).contiguous()
        slots = slot_mapping.to(torch.int64).contiguous()
        tables = block_tables.contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        plan = None if lora is None else lora.struct()
        rc = load_library().llama_decode_layers_f32(
            self.num_layers, self._layer_ptrs, self._final_norm.data_ptr() if final else None,
            x.data_ptr(), None if residual_in is None else residual_in.data_ptr(), out.data_ptr(),
            None if residual_out is None else residual_out.data_ptr(), rows, s.hidden, s.num_heads, s.num_kv_heads,
            s.head_dim, s.intermediate, s.eps, s.scale,
            positions.data_ptr(), cos_cache.data_ptr(), sin_cache.data_ptr(),
            slots.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
            max_seq_len, s.block_size, int(s.rope_interleaved),
            None if plan is None else ctypes.addressof(plan),
        )  # fmt: skip
        if rc == -1 or rc == -3:
            raise MemoryError("native decode layers: out of memory for scratch buffers.")
        if rc != 0:
            raise ValueError(f"native decode layers: a product kernel rejected its weight (code {rc}).")
        return out, residual_out
