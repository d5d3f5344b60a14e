"""Load llama.cpp GGUF checkpoints: metadata -> :class:`ModelConfig`, tensors -> HF-named weights.

With ``keep_quantized``, tensors of the types the quantized CPU kernels multiply (Q4_0, Q4_1, Q8_0,
Q4_K, Q5_K, Q6_K) stay in their GGUF blocks (:class:`~pagedllm.kernels.cpu.quant.QuantizedWeight`;
Q5_0 blocks become the Q8_0 blocks of the same values);
every other tensor (and every tensor without ``keep_quantized``) is dequantized to float32 with
``gguf.quants.dequantize`` (vectorised numpy). Names are mapped from llama.cpp's scheme (``blk.N.attn_q.weight``) to Hugging Face's (``model.layers.N.self_attn.q_proj.weight``).
For the "llama" architecture, llama.cpp's converter reorders the rows of the query and key
projections (it interleaves the two rotary halves of every head). With ``keep_quantized`` the rows
stay as stored (views of the file, no copy) and the config says ``rope_interleaved``: rotary
embedding rotates the interleaved pairs, which gives HF's attention scores (queries and keys share
the reordering). Otherwise the reordering is undone so that the weights are the original Hugging
Face model's. Gemma 2 / 3 files store every norm
weight plus one (llama.cpp's RMSNorm scales by the weight, Gemma's by one plus it); one is taken off
again here, as transformers' GGUF loader does.

:func:`load_gguf` takes an optional ``select`` (a :data:`~pagedllm.model.hf_loader.TensorSelector`)
that keeps only a slice of each tensor (quantized blocks are sliced as blocks), for ranks of a
tensor- or pipeline-parallel run that each hold a shard.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from pagedllm.kernels.cpu.quant import (
    LOADABLE_TYPES,
    SUPPORTED_TYPES,
    QuantizedWeight,
    q5_0_to_q8_0,
)
from pagedllm.model.config import ModelConfig, unsupported_architecture_error
from pagedllm.model.gguf_mapping import map_file_bytes, release_file_pages
from pagedllm.model.gguf_reader import open_gguf, read_metadata
from pagedllm.model.hf_loader import TensorSelector, check_selection, is_whole, meta_tensors

logger = logging.getLogger(__name__)

# Tensor types that hold float values as they are (dequantizing them is a plain conversion).
FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})

# llama.cpp architecture name -> internal architecture name.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
}

# Gemma's llama.cpp names that differ from the scheme above: its "ffn_norm" is the norm *before* the
# MLP, and the post-norms have their own tensors.
_GEMMA_BLOCK_TENSORS: dict[str, str] = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GEMMA_ARCHITECTURES = ("gemma2", "gemma3")

_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_BLOCK_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")

# llama.cpp tensors whose rows its converter reorders for the "llama" architecture (per head).
_ROTARY_PERMUTED = (".attn_q.weight", ".attn_q.bias", ".attn_k.weight", ".attn_k.bias")

# llama.cpp stores llama3-style RoPE scaling as this tensor of per-frequency divisors.
_ROPE_FREQS = "rope_freqs.weight"


def _f32(value: float) -> float:
    """A float32 metadata value as the short decimal it was written from (9.99999975e-06 -> 1e-05)."""
    return float(f"{float(value):.7g}")


def gguf_architecture(reader: GGUFReader) -> str:
    """The internal architecture name of a GGUF file; ValueError naming it when unsupported."""
    arch = read_metadata(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise unsupported_architecture_error(f"{arch} (GGUF)")
    return GGUF_ARCHITECTURES[arch]


def gguf_config(reader: GGUFReader, rope_freqs: np.ndarray | None = None) -> ModelConfig:
    """Build a :class:`ModelConfig` from GGUF metadata.

    ``rope_freqs`` is the dequantized ``rope_freqs.weight`` tensor when the file has one (llama3-style
    RoPE scaling). ``eos_token_ids`` holds the file's EOS and, when different, its end-of-turn token.
    """
    gguf_arch = read_metadata(reader, "general.architecture")
    arch = gguf_architecture(reader)

    def meta(key: str, default: Any = None, *, required: bool = False) -> Any:
        value = read_metadata(reader, f"{gguf_arch}.{key}", default)
        if value is None and required:
            raise ValueError(f"GGUF metadata key '{gguf_arch}.{key}' is missing.")
        return value

    tensor_names = {t.name for t in reader.tensors}
    hidden_size = int(meta("embedding_length", required=True))
    num_heads = int(meta("attention.head_count", required=True))
    num_kv_heads = meta("attention.head_count_kv", num_heads)
    intermediate = meta("feed_forward_length", required=True)
    if isinstance(num_kv_heads, list) or isinstance(intermediate, list):
        raise ValueError("GGUF files with per-layer head counts or feed-forward sizes are not supported.")
    head_dim = int(meta("attention.key_length") or hidden_size // num_heads)
    rope_theta = _f32(meta("rope.freq_base", 10000.0))

    vocab_size = meta("vocab_size")
    if vocab_size is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError("GGUF file has neither a vocab_size nor a tokenizer.ggml.tokens list.")
        vocab_size = len(tokens.data)

    eos_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        token_id = read_metadata(reader, key)
        if token_id is not None and int(token_id) not in eos_ids:
            eos_ids.append(int(token_id))
    bos = read_metadata(reader, "tokenizer.ggml.bos_token_id")
    num_layers = int(meta("block_count", required=True))
    gemma: dict[str, Any] = {}
    if arch in _GEMMA_ARCHITECTURES:
        gemma = _gemma_fields(meta, arch, num_layers, hidden_size // num_heads, head_dim)
        end_of_turn = _token_id(reader, "<end_of_turn>")
        if end_of_turn is not None and end_of_turn not in eos_ids:
            eos_ids.append(end_of_turn)

    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(intermediate),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(num_kv_heads),
        head_dim=head_dim,
        rms_norm_eps=_f32(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=_gguf_rope_scaling(meta, rope_freqs, rope_theta, head_dim),
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        **gemma,
    )


def _token_id(reader: GGUFReader, text: str) -> int | None:
    """The id of the vocabulary entry ``text`` in the file's tokenizer, or None."""
    tokens = read_metadata(reader, "tokenizer.ggml.tokens")
    if not tokens:
        return None
    try:
        return int(tokens.index(text))
    except ValueError:
        return None


# Layers per model of the 27B Gemma models, whose attention scale is not head_dim ** -0.5.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_fields(meta: Any, arch: str, num_layers: int, embd_per_head: int, head_dim: int) -> dict[str, Any]:
    """The Gemma-only :class:`ModelConfig` fields of a GGUF file.

    The files carry the window and (Gemma 2) the soft-caps; what they leave out is what llama.cpp
    assumes: Gemma 2 alternates sliding and full layers, Gemma 3 makes every sixth layer full (unless
    ``attention.sliding_window_pattern`` says otherwise) and rotates sliding layers with base 10000
    (unless ``rope.freq_base_swa`` is set); queries are scaled by ``head_dim ** -0.5``, except in the
    27B models (``hidden_size / num_heads``).
    """
    window = meta("attention.sliding_window")
    pattern = meta("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if isinstance(pattern, list):  # one flag per layer: true for sliding layers
        layer_types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        layer_types = [
            "sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(num_layers)
        ]
    if window is None:
        raise ValueError(f"GGUF metadata key '{arch}.attention.sliding_window' is missing.")
    default_caps = (50.0, 30.0) if arch == "gemma2" else (None, None)
    attn_cap = meta("attn_logit_softcapping", default_caps[0])
    final_cap = meta("final_logit_softcapping", default_caps[1])
    local_base = meta("rope.freq_base_swa", 10000.0) if arch == "gemma3" else None
    scalar = embd_per_head if num_layers == _GEMMA_27B_LAYERS[arch] else head_dim
    return {
        "sliding_window": int(window),
        "layer_types": layer_types,
        "query_pre_attn_scalar": float(scalar),
        "attn_logit_softcapping": None if attn_cap is None else _f32(attn_cap),
        "final_logit_softcapping": None if final_cap is None else _f32(final_cap),
        "rope_local_base_freq": None if local_base is None else _f32(local_base),
    }


def _gguf_rope_scaling(
    meta: Any, rope_freqs: np.ndarray | None, rope_theta: float, head_dim: int
) -> dict[str, Any] | None:
    """RoPE scaling from ``{arch}.rope.scaling.*`` metadata or a ``rope_freqs`` tensor."""
    kind = meta("rope.scaling.type")
    factor = meta("rope.scaling.factor")
    original = meta("rope.scaling.original_context_length")
    if rope_freqs is not None:
        return _llama3_rope_scaling(rope_freqs, rope_theta, head_dim, original)
    if kind in (None, "none") or factor in (None, 0.0, 1.0):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _f32(factor)}
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    if kind == "yarn":
        scaling.update(_gguf_yarn_parameters(meta, original))
    return scaling


def _gguf_yarn_parameters(meta: Any, original: int | None) -> dict[str, Any]:
    """The YaRN parameters of Hugging Face's dict that llama.cpp's converter writes as metadata.

    ``rope.scaling.yarn_beta_fast`` / ``yarn_beta_slow`` are ``beta_fast`` / ``beta_slow`` and
    ``rope.scaling.yarn_attn_factor`` is ``attention_factor`` (written only when the original config
    sets one); without ``original_context_length`` the training context is the original length, as
    in both llama.cpp and transformers. Keys that would change the rotation in ways Hugging Face's
    YaRN has no parameter for (a log multiplier, an extrapolation factor other than 1, a general
    ``attn_factor``) are a ValueError naming them.
    """
    out: dict[str, Any] = {}
    if original is None:
        out["original_max_position_embeddings"] = int(meta("context_length", 2048))
    for key, name in (
        ("rope.scaling.yarn_beta_fast", "beta_fast"),
        ("rope.scaling.yarn_beta_slow", "beta_slow"),
        ("rope.scaling.yarn_attn_factor", "attention_factor"),
    ):
        value = meta(key)
        if value is not None:
            out[name] = _f32(value)
    for key, neutral in (
        ("rope.scaling.yarn_log_multiplier", (0.0,)),
        ("rope.scaling.yarn_ext_factor", (-1.0, 1.0)),  # -1: llama.cpp's "default", which is 1 for YaRN
        ("rope.scaling.attn_factor", (1.0,)),
    ):
        value = meta(key)
        if value is not None and _f32(value) not in neutral:
            raise ValueError(f"GGUF YaRN metadata '{key}' = {value} is not supported.")
    return out


def _llama3_rope_scaling(
    freq_factors: np.ndarray, rope_theta: float, head_dim: int, original_context: int | None
) -> dict[str, Any]:
    """Recover Hugging Face's llama3 ``rope_scaling`` dict from llama.cpp's ``rope_freqs`` tensor.

    llama.cpp precomputes, per rotary frequency, the divisor llama3 scaling applies. Its parameters
    are recovered by taking ``factor`` as the largest divisor and checking the standard
    ``low_freq_factor=1``, ``high_freq_factor=4`` against the whole tensor.
    """
    freq_factors = np.asarray(freq_factors, dtype=np.float64).reshape(-1)
    factor = float(freq_factors.max())
    candidate = {
        "rope_type": "llama3",
        "factor": _f32(factor),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": int(original_context or 8192),
    }
    expected = llama3_rope_freq_factors(candidate, rope_theta, head_dim)
    if expected.shape != freq_factors.shape or not np.allclose(expected, freq_factors, rtol=1e-4):
        raise ValueError(
            "The GGUF file's rope_freqs tensor does not match llama3 RoPE scaling with "
            "low_freq_factor=1, high_freq_factor=4; this RoPE variant is not supported."
        )
    return candidate


def llama3_rope_freq_factors(scaling: dict[str, Any], rope_theta: float, head_dim: int) -> np.ndarray:
    """The per-frequency divisors of llama3 RoPE scaling, as llama.cpp stores them in ``rope_freqs``."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    freqs = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (old_len / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_len / high, 1.0, np.where(wavelen > old_len / low, factor, mid))


def hf_tensor_name(gguf_name: str, gguf_arch: str = "llama") -> str | None:
    """The Hugging Face parameter name of a llama.cpp tensor name of architecture ``gguf_arch``, or
    None when it has none."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None:
        return None
    block = _GEMMA_BLOCK_TENSORS if gguf_arch in _GEMMA_ARCHITECTURES else {}
    name = block.get(m.group(2), _BLOCK_TENSORS.get(m.group(2)))
    return None if name is None else f"model.layers.{m.group(1)}.{name}"


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of the q/k projection rows (weight or bias) of ``num_heads`` heads.

    The converter maps HF rows ``(head, half, i)`` to ``(head, i, half)``, i.e. it interleaves the
    two rotary halves of each head; this swaps them back.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def _hf_shape(tensor: Any) -> tuple[int, ...]:
    """The logical shape of a reader tensor, outermost dimension first (``[out, in]`` for a weight)."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _dequantize_f32(tensor: Any, rows: slice | None = None) -> np.ndarray:
    """Dequantize a reader tensor into an owned, writable float32 array of its logical shape.

    ``rows`` (a step-1 slice of the outermost dimension of a tensor of two or more dimensions) reads
    and dequantizes only those rows."""
    shape = _hf_shape(tensor)
    data = tensor.data
    if rows is not None:
        begin, end, _ = rows.indices(shape[0])
        data = data[begin : max(begin, end)]
        shape = (data.shape[0], *shape[1:])
    arr = dequantize(data, tensor.tensor_type)
    if arr.dtype != np.float32 or not arr.flags.writeable:
        arr = np.array(arr, dtype=np.float32)  # copies out of the read-only file mapping
    return arr.reshape(shape)


def _selected_f32(tensor: Any, index: tuple[slice, ...]) -> np.ndarray:
    """The part ``index`` selects of a reader tensor, as an owned contiguous float32 array (only the
    selected rows of a tensor of two or more dimensions are dequantized)."""
    if len(index) and len(_hf_shape(tensor)) >= 2:
        arr = _dequantize_f32(tensor, rows=index[0])  # owns just these rows
        rest: tuple[slice, ...] = (slice(None), *index[1:])
    else:
        arr, rest = _dequantize_f32(tensor), index
    if is_whole(rest, arr.shape):
        return arr
    return np.array(arr[rest], dtype=np.float32, order="C", copy=True)  # keeps only the shard


def _selected_quantized(tensor: Any, hf_name: str, index: tuple[slice, ...]) -> QuantizedWeight:
    """The part ``index`` selects of a 2-D reader tensor of a :data:`LOADABLE_TYPES` type, as GGUF
    blocks: a row range takes those rows' blocks; a column range must start and end on a block
    boundary (ValueError naming the tensor otherwise) and takes the matching bytes of every row."""
    type_name = GGMLQuantizationType(tensor.tensor_type).name
    out_features, in_features = _hf_shape(tensor)
    rows = index[0] if len(index) > 0 else slice(None)
    cols = index[1] if len(index) > 1 else slice(None)
    r0, r1, _ = rows.indices(out_features)
    c0, c1, _ = cols.indices(in_features)
    r1, c1 = max(r0, r1), max(c0, c1)
    values, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.tensor_type)]
    if c0 % values or c1 % values:
        raise ValueError(
            f"Cannot load columns {c0}:{c1} of the {type_name} tensor {hf_name} as quantized blocks: a "
            f"column range must start and end on a multiple of the block size ({values} values). "
            'Load the model with quantization="none" (float32 weights), or use a parallel layout whose '
            "shards are block-aligned."
        )
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(out_features, -1)
    blocks = np.array(raw[r0:r1, c0 // values * nbytes : c1 // values * nbytes], dtype=np.uint8, copy=True)
    if type_name == "Q5_0":
        return QuantizedWeight("Q8_0", (r1 - r0, c1 - c0), torch.from_numpy(q5_0_to_q8_0(blocks)))
    return QuantizedWeight(type_name, (r1 - r0, c1 - c0), torch.from_numpy(blocks))


def load_gguf(
    path: str, keep_quantized: bool = False, *, select: TensorSelector | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantizedWeight]]:
    """Read a GGUF file: its :class:`ModelConfig` and weights under Hugging Face names.

    Weights are float32 tensors, or with ``keep_quantized`` :class:`QuantizedWeight` blocks for the
    2-D tensors of a type the quantized kernels take (the others are dequantized, logged once by type).
    Raises ValueError for an unsupported architecture, an unknown tensor, or tensors that do not
    match the metadata.

    ``select`` (a :data:`~pagedllm.model.hf_loader.TensorSelector`, called with the Hugging Face name
    and full Hugging Face shape) keeps only a slice of each tensor and leaves out the tensors it
    skips; only the selected rows are copied or dequantized. A column range of a tensor kept
    quantized must be block-aligned (ValueError naming the tensor otherwise). The llama q/k row
    reordering is undone on the selected rows, which must then be whole heads. The names and full
    shapes of all the file's tensors are still checked against the metadata.
    """
    reader = open_gguf(path)
    gguf_arch = read_metadata(reader, "general.architecture")
    gguf_architecture(reader)  # fail fast on unsupported architectures
    by_name = {t.name: t for t in reader.tensors}
    experts = next((name for name in by_name if name.endswith("_exps.weight")), None)
    if experts is not None:
        raise ValueError(
            f"GGUF file {path} holds mixture-of-experts tensors ('{experts}'): MoE models load from "
            "Hugging Face checkpoints only (GGUF experts are not supported)."
        )
    rope_freqs = _dequantize_f32(by_name[_ROPE_FREQS]) if _ROPE_FREQS in by_name else None
    config = gguf_config(reader, rope_freqs)
    # The q/k rows stay in the file's order (no copy) when the weights stay in the file's blocks.
    unpermute = gguf_arch == "llama" and not (keep_quantized and not config.qk_norm)
    if gguf_arch == "llama" and not unpermute:
        config = dataclasses.replace(config, rope_interleaved=True)

    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    file_bytes = map_file_bytes(reader)
    full_shapes: dict[str, tuple[int, ...]] = {}
    dequantized: dict[str, int] = {}
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            continue
        hf_name = hf_tensor_name(tensor.name, gguf_arch)
        if hf_name is None:
            raise ValueError(f"Unexpected tensor '{tensor.name}' in {gguf_arch} GGUF file {path}.")
        index: tuple[slice, ...] = ()
        row_sliced = False
        if select is not None:
            shape = full_shapes[hf_name] = _hf_shape(tensor)
            chosen = select(hf_name, shape)
            if chosen is None:
                continue
            index = check_selection(hf_name, shape, chosen)
            if is_whole(index, shape):
                index = ()
            row_sliced = len(index) > 0 and not is_whole(index[:1], shape)
        type_name = GGMLQuantizationType(tensor.tensor_type).name
        quantized = keep_quantized and type_name in LOADABLE_TYPES and len(tensor.shape) == 2
        if keep_quantized and not quantized and type_name not in FLOAT_TYPES:
            dequantized[type_name] = dequantized.get(type_name, 0) + 1
        weight: QuantizedWeight | None = None
        if quantized:
            if index:
                weight = _selected_quantized(tensor, hf_name, index)
            elif type_name in SUPPORTED_TYPES:  # a view of the file mapping: no copy
                rows = int(math.prod(tensor.shape[1:]))
                end = tensor.data_offset + tensor.n_bytes
                blocks = file_bytes[tensor.data_offset : end].view(rows, -1)
                weight = QuantizedWeight(type_name, (rows, int(tensor.shape[0])), blocks)
            else:  # repacked (Q5_0 as Q8_0): a copy
                weight = QuantizedWeight.from_gguf(tensor)
                release_file_pages(reader, tensor.data_offset, tensor.n_bytes)
            arr = mapped = weight.blocks.numpy()
        else:  # float32 copies: the file pages read for them are not kept
            arr = _selected_f32(tensor, index) if index else _dequantize_f32(tensor)
            release_file_pages(reader, tensor.data_offset, tensor.n_bytes)
        if gguf_arch == "llama" and tensor.name.endswith(_ROTARY_PERMUTED):
            # A shard holds whole heads (their rows are reordered within each head). Unpermuting
            # moves whole rows (a quantized row's blocks with it): the selected heads by themselves.
            is_q = tensor.name.endswith((".attn_q.weight", ".attn_q.bias"))
            heads = config.num_attention_heads if is_q else config.num_key_value_heads
            if row_sliced:
                heads = _selected_heads(hf_name, index[0], full_shapes[hf_name][0], config.head_dim)
            if unpermute:
                arr = unpermute_rotary_rows(arr, heads)
                if weight is not None and not index:
                    release_file_pages(reader, tensor.data_offset, tensor.n_bytes)  # now a copy
        if gguf_arch in _GEMMA_ARCHITECTURES and tensor.name.endswith("norm.weight"):
            # llama.cpp's converter stores Gemma's norm weights plus one (its RMSNorm scales by the
            # weight); the model here scales by 1 + weight, as transformers does.
            arr = arr - np.float32(1.0)
        if weight is not None:
            if arr is not mapped:
                weight = QuantizedWeight(
                    weight.type_name, weight.shape, torch.from_numpy(np.ascontiguousarray(arr))
                )
            weights[hf_name] = weight
        else:
            weights[hf_name] = torch.from_numpy(arr)
    if dequantized:
        logger.warning(
            "%s: tensors of types without quantized CPU kernels were dequantized to float32: %s",
            os.path.basename(path),
            ", ".join(f"{t} ({n} tensors)" for t, n in sorted(dequantized.items())),
        )
    config.check_weights(weights if select is None else meta_tensors(full_shapes), path)
    return config, weights


def _selected_heads(hf_name: str, rows: slice, full_rows: int, head_dim: int) -> int:
    """The number of heads in the rows ``rows`` selects of a q/k projection (weight or bias) of
    ``full_rows`` rows; ValueError naming the tensor unless they are whole heads of ``head_dim`` rows."""
    begin, end, _ = rows.indices(full_rows)
    end = max(begin, end)
    if begin % head_dim or end % head_dim:
        raise ValueError(
            f"The selected rows {begin}:{end} of {hf_name} do not cover whole heads of {head_dim} rows."
        )
    return (end - begin) // head_dim


def gguf_display_name(path: str) -> str:
    """A readable model name from a GGUF file name, without the quantization suffix.

    ``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``.
    """
    stem = os.path.basename(path)
    if stem.lower().endswith(".gguf"):
        stem = stem[: -len(".gguf")]
    quant = re.compile(r"[.\-_](?:I?Q\d[A-Za-z0-9_]*|B?F16|F32|FP16|FP32)$", re.IGNORECASE)
    return quant.sub("", stem) or stem
