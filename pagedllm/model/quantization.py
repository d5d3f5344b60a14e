"""How a model's weights are held: the engine argument ``quantization`` and the layers it installs.

* ``auto``: a GGUF file's quantized tensors stay in their blocks on the CPU (:func:`install_gguf_blocks`:
  :class:`~pagedllm.kernels.cpu.quant_linear.QuantLinear` projections and LM head,
  :class:`~pagedllm.kernels.cpu.quant_linear.QuantEmbedding`), a safetensors checkpoint is used as
  stored. On a GPU, which has no kernels for GGUF blocks, the file is dequantized to ``dtype``.
* ``none``: every weight dequantized to ``dtype`` (the path the HF-equivalence tests check).
* ``int8`` / ``fp8``: weight-only quantization of a float checkpoint at load, one scale per output
  channel (:func:`quantize_float_linears`); int8 runs on the CPU as Q8_0 blocks of the quantized
  kernels and on a GPU through :class:`~pagedllm.model.weight_quant.Int8Linear`; fp8 needs a GPU.

:func:`check_before_loading` and :func:`settle_weights` (on a checkpoint loaded with its GGUF blocks
kept, so that the file is read once) check a combination; an impossible one is a ``ValueError``
naming the field.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedllm.kernels.cpu.quant import QuantizedWeight, dequantize
from pagedllm.kernels.cpu.quant_linear import QuantEmbedding, QuantLinear
from pagedllm.model.llama import DecoderLayer, LlamaForCausalLM
from pagedllm.model.moe import is_moe_model
from pagedllm.model.weight_quant import check_fp8_supported, int8_per_channel_q8_0, quantize_linears

logger = logging.getLogger(__name__)


def check_before_loading(method: str, device: torch.device, dtype: torch.dtype) -> None:
    """What ``quantization=method`` rules out whatever the checkpoint: ``ValueError`` naming the field."""
    if method == "int8" and device.type == "cpu" and dtype != torch.float32:
        raise ValueError(
            f"quantization='int8' on the CPU runs the quantized kernels, which take float32 activations; "
            f"dtype={_dtype_name(dtype)!r} is not possible with it (use dtype='float32' or 'auto')."
        )


def settle_weights(
    method: str,
    weights: dict[str, torch.Tensor | QuantizedWeight],
    source: str,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """The weights to load for ``quantization=method``, from a checkpoint loaded with its GGUF blocks
    kept (every method but ``none``): the blocks themselves, or on a GPU their float values; a new
    dict, ``weights`` is not changed. Raises ``ValueError`` naming the field for an impossible
    combination (``source``, the checkpoint's path, is named too)."""
    types = ", ".join(sorted({w.type_name for w in weights.values() if isinstance(w, QuantizedWeight)}))
    if method in ("int8", "fp8") and types:
        raise ValueError(
            f"quantization={method!r} quantizes a float checkpoint, but {source} is already quantized "
            f"({types}); use quantization='auto' to run its blocks or 'none' to dequantize them."
        )
    if method == "fp8":
        check_fp8_supported(device)
    if not types:
        return dict(weights)
    if device.type != "cpu":
        logger.info(
            "GGUF blocks (%s) have kernels on the CPU only: dequantized to %s on %s.", types, dtype, device
        )
        return {name: _float(w) for name, w in weights.items()}
    if dtype != torch.float32:
        raise ValueError(
            f"quantization='auto' runs this GGUF file's quantized blocks ({types}), whose CPU kernels take "
            f"float32 activations; dtype={_dtype_name(dtype)!r} is not possible with it: use dtype='float32' "
            f"(or 'auto'), or quantization='none' to dequantize the weights to {_dtype_name(dtype)}."
        )
    return dict(weights)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _float(weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    return dequantize(weight) if isinstance(weight, QuantizedWeight) else weight


def install_gguf_blocks(
    model: LlamaForCausalLM, weights: dict[str, torch.Tensor | QuantizedWeight]
) -> dict[str, torch.Tensor]:
    """Put ``weights``' GGUF blocks into ``model`` as quantized layers; returns the float weights left
    for :meth:`LlamaForCausalLM.load_weights` (``weights`` itself is not changed).

    A fused projection (q/k/v, gate/up) is quantized when all its parts are; if only some are, they
    are dequantized. A tied LM head reads the embedding's blocks (one copy).
    """
    floats = {n: w for n, w in weights.items() if isinstance(w, torch.Tensor)}
    blocks = {n: w for n, w in weights.items() if isinstance(w, QuantizedWeight)}
    if not blocks:
        return floats
    cfg = model.config

    def fused(names: list[str], bias: bool) -> QuantLinear | None:
        parts = [blocks.get(name) for name in names]
        found = [p for p in parts if p is not None]
        if len(found) == len(names):
            for name in names:
                del blocks[name]
            return QuantLinear(found, bias=bias)
        for name in names:  # a mix of float and quantized parts: all float
            if name in blocks:
                floats[name] = dequantize(blocks.pop(name))
        return None

    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        qkv = fused([p + f"self_attn.{x}_proj.weight" for x in "qkv"], cfg.attention_bias)
        if qkv is not None:
            attn.qkv_proj = qkv
        if (o := fused([p + "self_attn.o_proj.weight"], False)) is not None:
            attn.o_proj = o
        gate_up = fused([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], False)
        if gate_up is not None:
            mlp.gate_up_proj = gate_up
        if (down := fused([p + "mlp.down_proj.weight"], False)) is not None:
            mlp.down_proj = down
    embed = blocks.pop("model.embed_tokens.weight", None)
    if embed is not None:
        model.embed_tokens = QuantEmbedding(embed)
        if cfg.tie_word_embeddings:
            model.lm_head = QuantLinear([embed])
    head = blocks.pop("lm_head.weight", None)
    if head is not None:
        model.lm_head = QuantLinear([head])
    floats.update({name: _float(w) for name, w in blocks.items()})  # any other 2-D tensor
    return floats


def quantize_float_linears(model: LlamaForCausalLM, method: str, device: torch.device) -> int:
    """Replace the float projections of ``model`` (on ``device``, already in its dtype) by weight-only
    ``int8`` / ``fp8`` layers; returns how many were replaced. A tied LM head stays in the model dtype
    (it is the embedding table)."""
    if method not in ("int8", "fp8"):
        raise ValueError(f"quantize_float_linears takes 'int8' or 'fp8', not {method!r}.")
    if is_moe_model(model):
        raise ValueError(
            f"quantization={method!r} is not supported for mixture-of-experts models (their stacked expert "
            "weights have no quantized kernels); use quantization='none' or 'auto'."
        )
    if device.type != "cpu":
        return quantize_linears(model, method, device)
    count = 0
    tied = model.embed_tokens.weight if isinstance(model.embed_tokens, nn.Embedding) else None
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or child.weight is tied:
                continue
            weight = child.weight.detach().float()
            blocks = QuantizedWeight("Q8_0", tuple(weight.shape), int8_per_channel_q8_0(weight))  # type: ignore[arg-type]
            layer = QuantLinear([blocks], bias=child.bias is not None)
            if child.bias is not None:
                assert layer.bias is not None
                layer.bias.data.copy_(child.bias.detach().float())
            setattr(parent, name, layer)
            count += 1
    return count
