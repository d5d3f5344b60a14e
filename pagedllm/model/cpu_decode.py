"""Decode-only steps of a Llama-family model on the CPU through one native call.

A decode step calls some three hundred kernels (four matrix products, three elementwise kernels, a
K/V write and the paged attention per layer); from Python each costs interpreter and dispatch time
(and the interpreter's cache misses between kernels), which at decode batch sizes comes to a sixth
of the step at 32 sequences and a third at 4. :class:`NativeDecodeLayers` runs
the same kernels in the same order from C (``llama_decode_layers_f32`` in
``pagedllm/kernels/csrc/decode_layers_cpu.c``), on the model's own weights (float32 panels or GGUF
blocks) and KV cache, so its hidden states equal the Python forward's. Steps with any prompt chunk, and models it does not
cover, take the Python forward; ``enforce_eager`` turns it off, as it does CUDA graphs.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.base import AttentionMetadata
from pagedllm.kernels.cpu.decode_layers import (
    DecodeLayersKernel,
    DecodeLayerTensors,
    DecodeShape,
    LoRAPlan,
    LoRASlotsView,
)
from pagedllm.kernels.cpu.library import kernels_available
from pagedllm.kernels.cpu.linear import PanelLinear
from pagedllm.kernels.cpu.quant_linear import QuantLinear
from pagedllm.model.llama import DecoderLayer, LlamaForCausalLM
from pagedllm.model.moe import is_moe_model


def unsupported_reason(model: LlamaForCausalLM, attention_backend: str) -> str | None:
    """Why :class:`NativeDecodeLayers` cannot run ``model``, or None when it can."""
    if attention_backend != "cpu":
        return f"attention backend {attention_backend!r} (needs 'cpu')"
    if is_moe_model(model):
        return "mixture-of-experts layers"
    if type(model) is not LlamaForCausalLM:
        return f"{type(model).__name__} layers (Llama-family layers only)"
    if not kernels_available():
        return "native kernels unavailable"
    norm = model.norm.weight
    if norm.dtype != torch.float32 or norm.device.type != "cpu":
        return "not a float32 CPU model"
    for layer in _decoder_layers(model):
        reason = _adapter_reason(layer)
        if reason is not None:
            return reason
        linears = tuple(_unwrap(m)[0] for m in _linears(layer))
        if not all(isinstance(m, (PanelLinear, QuantLinear)) for m in linears):
            return "linear layers neither in panel form nor GGUF blocks"
        if any(isinstance(m, QuantLinear) and len(m.parts) > 4 for m in linears):
            return "a projection of more than four quantized parts"
        if layer.self_attn.q_norm is not None:
            return "q/k norms"
        if getattr(layer.self_attn, "sliding_window", None) is not None:
            return "sliding-window attention"
        if getattr(layer.self_attn, "logits_soft_cap", None) is not None:
            return "attention logit soft-capping"
        if any(m.bias is not None for m in linears[1:]):
            return "biases outside the q/k/v projection"
    return None


def _decoder_layers(model: LlamaForCausalLM) -> list[DecoderLayer]:
    layers = [layer for layer in model.layers if isinstance(layer, DecoderLayer)]
    assert len(layers) == len(model.layers)
    return layers


def _linears(layer: DecoderLayer) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
    """q/k/v, output, gate/up and down projections, in the order the layer runs them."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _adapter_reason(layer: DecoderLayer) -> str | None:
    """Why the native layers cannot add ``layer``'s adapters, or None (no adapters, or they can)."""
    for module in _linears(layer):
        base, slots = _unwrap(module)
        if base is module:
            continue  # no adapter layer
        if slots is None:
            return "LoRA adapter slots the native layers cannot read"
        if isinstance(base, QuantLinear):
            # Not yet: on GGUF blocks the native layers' adapter sums drift from the Python forward's.
            return "LoRA adapters over GGUF blocks"
    return None


def _unwrap(module: nn.Module) -> tuple[nn.Module, LoRASlotsView | None]:
    """``(the projection, its adapter slots or None)``: a projection wrapped by an adapter layer
    (:class:`pagedllm.lora.layers.LoRALinear`) exposes ``base`` and ``native_slots()``."""
    native_slots = getattr(module, "native_slots", None)
    if native_slots is None:
        return module, None
    return module.base, native_slots()  # type: ignore[return-value]


def _kernel_linear(module: nn.Module) -> PanelLinear | QuantLinear:
    if not isinstance(module, (PanelLinear, QuantLinear)):
        raise ValueError("native decode needs panel or quantized linear layers (see unsupported_reason).")
    return module


class NativeDecodeLayers:
    """The decoder layers and final norm of ``model`` for steps whose every row is a decode.

    Gathers the model's parameters, its panel or quantized weights and ``kv_caches`` (per layer ``(k, v)``, each
    ``[num_blocks, block_size, kv_heads, head_dim]`` contiguous) for
    :class:`~pagedllm.kernels.cpu.decode_layers.DecodeLayersKernel`: those tensors must stay alive
    and in place for as long as this object is used.
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        cfg = model.config
        self.model = model
        layers = _decoder_layers(model)
        tensors = []
        for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
            unwrapped = [_unwrap(m) for m in _linears(layer)]
            qkv, o, gate_up, down = (_kernel_linear(m) for m, _ in unwrapped)
            names = ("qkv", "o", "gate_up", "down")
            lora = {
                name: slots for name, (_, slots) in zip(names, unwrapped, strict=True) if slots is not None
            }
            tensors.append(
                DecodeLayerTensors(
                    input_norm=layer.input_layernorm.weight,
                    qkv=qkv,
                    o=o,
                    post_attention_norm=layer.post_attention_layernorm.weight,
                    gate_up=gate_up,
                    down=down,
                    k_cache=k_cache,
                    v_cache=v_cache,
                    lora=lora,
                )
            )
        shape = DecodeShape(
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            hidden=cfg.hidden_size,
            intermediate=cfg.intermediate_size,
            eps=float(model.norm.eps),
            scale=float(layers[0].self_attn.scale),
            block_size=kv_caches[0][0].shape[1],
            rope_interleaved=cfg.rope_interleaved,
        )
        self.kernel = DecodeLayersKernel(tensors, model.norm.weight, shape)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoRAPlan | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token (all decodes); ``lora``: the
        rows' adapter slots (None: every row runs the base model)."""
        return self.forward_layers(input_ids, positions, meta, final=True, lora=lora)[0]

    def forward_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        carried: tuple[torch.Tensor, torch.Tensor] | None = None,
        final: bool = False,
        lora: LoRAPlan | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A pipeline stage's decode rows, as :meth:`LlamaForCausalLM.forward_layers` (``carried``:
        the stage before's ``(x, residual)``); with ``final`` the first item is after the final norm
        (the second is then the input ``x``, unused)."""
        rotary = self.model.rotary
        x = self.model.embed_tokens(input_ids) if carried is None else carried[0]
        out, residual = self.kernel(
            x,
            positions,
            rotary.cos_cache,
            rotary.sin_cache,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            meta.max_seq_len,
            residual=None if carried is None else carried[1],
            final=final,
            lora=lora,
        )
        return out, x if residual is None else residual
