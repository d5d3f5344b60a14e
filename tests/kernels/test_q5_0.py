"""Q5_0 GGUF blocks: loaded as the Q8_0 blocks of the same values (``q5_0_to_q8_0``) and multiplied
by the Q8_0 kernels; checked bitwise against gguf's Q5_0 dequantizer and against a float64
dequantize-then-multiply reference."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from pagedllm.kernels.cpu.library import kernels_available
from pagedllm.kernels.cpu.quant import (
    LOADABLE_TYPES,
    QuantizedWeight,
    dequantize,
    gather_rows,
    q5_0_to_q8_0,
    quant_matmul,
)

Q5_0 = GGMLQuantizationType.Q5_0
Q8_0 = GGMLQuantizationType.Q8_0


def q5_0_blocks(rows: int, cols: int, seed: int) -> np.ndarray:
    """Q5_0 rows from gguf's quantizer, with one block of every bit pattern's extremes."""
    rng = np.random.default_rng(seed)
    dense = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    dense[0, :32] = np.linspace(-1.0, 1.0, 32, dtype=np.float32)  # quants from -16 to 15
    return np.ascontiguousarray(gguf_quantize(dense, Q5_0))


def test_repacked_values_are_bitwise_gguf() -> None:
    blocks = q5_0_blocks(7, 160, seed=0)
    repacked = q5_0_to_q8_0(blocks)
    assert repacked.shape == (7, 5 * 34) and repacked.dtype == np.uint8
    expected = gguf_dequantize(blocks, Q5_0)
    assert np.array_equal(gguf_dequantize(repacked, Q8_0).view(np.uint32), expected.view(np.uint32))
    quants = repacked.reshape(-1, 34)[:, 2:].view(np.int8)
    assert quants.min() == -16 and quants.max() == 15


def test_random_bytes_repack_exactly() -> None:
    """Every byte pattern of quants and high bits (scales kept finite)."""
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(64, 22), dtype=np.uint8)
    blocks[:, :2] = rng.uniform(-2e-2, 2e-2, 64).astype(np.float16).view(np.uint8).reshape(64, 2)
    rows = blocks.reshape(8, 8 * 22)
    expected = gguf_dequantize(rows, Q5_0)
    got = gguf_dequantize(q5_0_to_q8_0(rows), Q8_0)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_from_gguf_loads_q5_0_as_q8_0() -> None:
    assert "Q5_0" in LOADABLE_TYPES
    blocks = q5_0_blocks(6, 64, seed=2)
    tensor = SimpleNamespace(tensor_type=Q5_0, shape=np.array([64, 6]), data=blocks.reshape(-1))
    weight = QuantizedWeight.from_gguf(tensor)
    assert weight.type_name == "Q8_0" and weight.shape == (6, 64)
    expected = gguf_dequantize(blocks, Q5_0)
    assert np.array_equal(dequantize(weight).numpy().view(np.uint32), expected.view(np.uint32))
    ids = torch.tensor([5, 0, 3])
    assert torch.equal(gather_rows(weight, ids), torch.from_numpy(expected[[5, 0, 3]]))


@pytest.mark.skipif(not kernels_available(), reason="no C compiler for the CPU kernels")
@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("shape", [(5, 32), (67, 96), (33, 288)])
def test_matmul_against_float64_reference(shape: tuple[int, int], portable: bool) -> None:
    out_features, in_features = shape
    blocks = q5_0_blocks(out_features, in_features, seed=out_features)
    tensor = SimpleNamespace(tensor_type=Q5_0, shape=np.array([in_features, out_features]), data=blocks)
    weight = QuantizedWeight.from_gguf(tensor)
    w = gguf_dequantize(blocks, Q5_0).astype(np.float64)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, in_features, generator=gen)
    x[1, 5] = 30.0
    y = quant_matmul(x, weight, portable=portable).numpy().astype(np.float64)
    x64 = x.numpy().astype(np.float64)

    # The kernel quantizes x to int8 per 32 values (step max|x| / 127): at most half a step a value,
    # plus float32 rounding of sums of magnitudes up to |w| and its block's offset terms.
    def per_value(a: np.ndarray) -> np.ndarray:
        peak = np.abs(a).reshape(a.shape[0], -1, 32).max(axis=-1, keepdims=True)
        return np.broadcast_to(peak, (a.shape[0], in_features // 32, 32)).reshape(a.shape[0], in_features)

    steps = per_value(x64) / 127.0
    slack = 1e-5 * (np.abs(x64) @ (np.abs(w) + 4 * per_value(w)).T)
    bound = 0.5 * (1 + 1e-3) * (steps @ np.abs(w).T) + slack
    err = np.abs(y - x64 @ w.T)
    assert (err <= bound).all(), f"error {err.max():.3e} over the activation-rounding bound"
