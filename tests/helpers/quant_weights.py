"""Quantized weights for tests: GGUF blocks of every supported type, from real values where gguf's
NumPy quantizer can make them and as random valid blocks (the K types) where it cannot."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from pagedllm.kernels.cpu.quant import QuantizedWeight, block_size

K_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _gguf_quantizes(type_name: str) -> bool:
    try:
        gguf_quantize(np.zeros((1, 256), dtype=np.float32), GGMLQuantizationType[type_name])
    except NotImplementedError:
        return False
    return True


def random_k_blocks(type_name: str, count: int, rng: np.random.Generator) -> np.ndarray:
    """Valid K blocks, byte-wise: random quants and 6-bit (Q6_K: 8-bit) scales and mins, and f16
    super-block scales of either sign between 1e-3 and 4e-3 (so that no value is inf or NaN)."""
    blocks = rng.integers(0, 256, size=(count, K_BLOCK_BYTES[type_name]), dtype=np.uint8)

    def f16(n: int) -> np.ndarray:
        values = rng.uniform(1e-3, 4e-3, n) * rng.choice([-1.0, 1.0], n)
        return values.astype(np.float16).view(np.uint8).reshape(n, 2)

    if type_name == "Q6_K":
        blocks[:, 208:210] = f16(count)
    else:
        blocks[:, 0:2] = f16(count)  # d
        blocks[:, 2:4] = f16(count)  # dmin
    return blocks


def random_weight(
    type_name: str, out_features: int, in_features: int, seed: int
) -> tuple[QuantizedWeight, np.ndarray]:
    """A weight of ``type_name`` and its float32 values as gguf dequantizes them."""
    rng = np.random.default_rng(seed)
    kind = GGMLQuantizationType[type_name]
    if _gguf_quantizes(type_name):
        dense = (rng.standard_normal((out_features, in_features)) * 0.05).astype(np.float32)
        blocks = gguf_quantize(dense, kind)
    else:
        count = out_features * in_features // block_size(type_name)
        blocks = random_k_blocks(type_name, count, rng).reshape(out_features, -1)
    blocks = np.ascontiguousarray(blocks)
    weight = QuantizedWeight(type_name, (out_features, in_features), torch.from_numpy(blocks.copy()))
    return weight, gguf_dequantize(blocks, kind)
