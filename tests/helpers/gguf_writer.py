"""Tiny GGUF files written as llama.cpp writes them (names, metadata, the llama q/k row order), from
tiny HF checkpoints, with float or quantized tensors."""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from helpers.quant_weights import random_k_blocks
from pagedllm.model.config import ModelConfig


def quantized_blocks(tensor: torch.Tensor, type_name: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF blocks ``[rows, row_bytes]`` of ``type_name`` for a 2-D weight and the float32 values they
    hold: ``tensor`` quantized when gguf can, else random valid K blocks."""
    kind = GGMLQuantizationType[type_name]
    values = tensor.float().numpy()
    try:
        blocks = gguf_quantize(values, kind)
    except NotImplementedError:
        rows = values.shape[0]
        count = values.size // 256
        blocks = random_k_blocks(type_name, count, np.random.default_rng(seed)).reshape(rows, -1)
    return blocks, np.ascontiguousarray(gguf_dequantize(blocks, kind), dtype=np.float32)


_HF_TO_GGUF_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_shape_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    """The ``{arch}.*`` shape keys llama.cpp's converter writes, from a config with Hugging Face's
    attribute names (a :class:`ModelConfig` or a transformers config)."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def write_tiny_gguf(
    path: str,
    arch: str,
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    rope_freqs: np.ndarray | None = None,
    types: dict[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Write ``weights`` as llama.cpp would; return the weights the file holds (float32).

    2-D tensors are F16, or of the GGML type ``types`` names for their HF name: quantized from the
    values where gguf's NumPy quantizer can (Q4_0, Q4_1, Q5_0, Q8_0, ...), random valid blocks for the
    K types (whose values then replace the given ones in the returned weights)."""
    writer = gguf.GGUFWriter(path, arch)
    add_shape_metadata(writer, cfg)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(5)
    expected: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            gguf_name = f"blk.{layer}.{_HF_TO_GGUF_BLOCK[rest]}"
        else:
            gguf_name = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        type_name = (types or {}).get(name)
        raw_dtype = None
        if type_name is None:
            arr = tensor.numpy().astype(np.float16 if tensor.ndim == 2 else np.float32)
            expected[name] = torch.from_numpy(arr.astype(np.float32))
        else:
            arr, values = quantized_blocks(tensor, type_name, seed=len(expected))
            expected[name] = torch.from_numpy(values)
            raw_dtype = GGMLQuantizationType[type_name]
        if arch == "llama" and ".attn_q." in gguf_name:
            arr = _llama_cpp_permute(arr, cfg.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            arr = _llama_cpp_permute(arr, cfg.num_key_value_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(arr), raw_dtype=raw_dtype)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected
