"""Weight-only quantized linear layers (int8, fp8), their Q8_0 form and the model-wide swap, on the CPU.

The error bounds are derived, not tuned: a float32 dot product of length K is within
``gamma_K * sum|x_i * w_i|`` of the exact one (``gamma_K = K u / (1 - K u)``, ``u = 2^-24``), each
further rounding adds ``u`` relative, and a value rounded to a grid of step ``s`` moves by at most
``s / 2``.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from torch import nn

from pagedllm.model.config import ModelConfig
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.weight_quant import (
    FP8_DTYPE,
    FP8_MIN_SCALE,
    Fp8Linear,
    Int8Linear,
    check_fp8_supported,
    fp8_supported,
    int8_per_channel_q8_0,
    int8_quantize_per_channel,
    quantize_activations_fp8,
    quantize_linears,
)

U32 = 2.0**-24  # float32 unit roundoff
U16 = 2.0**-8  # bfloat16 unit roundoff


def gamma(k: int, u: float = U32) -> float:
    return k * u / (1 - k * u)


def spread_linear(in_features: int, out_features: int, seed: int, bias: bool = True) -> nn.Linear:
    """A linear layer whose rows span five orders of magnitude, so that one scale for the whole
    tensor would be far off the per-channel bounds below."""
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        rows = torch.logspace(-3, 2, out_features)[torch.randperm(out_features, generator=g)]
        linear.weight.copy_(torch.randn(out_features, in_features, generator=g) * rows[:, None])
        if bias:
            linear.bias.copy_(torch.randn(out_features, generator=g))
    linear.requires_grad_(False)
    return linear


def exact_product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.double() @ w.double().t()
    return y if bias is None else y + bias.double()


# ---------------------------------------------------------------- int8


def test_int8_forward_is_the_product_with_the_dequantized_weight() -> None:
    linear = spread_linear(96, 40, seed=0)
    layer = Int8Linear.from_linear(linear)
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(1))
    q, s = layer.qweight.double(), layer.scale.double()
    exact = exact_product(x, q * s[:, None], linear.bias)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (7, 40)
    # (x @ q.T) in float32, times the scale (one rounding), plus the bias (one rounding).
    dot_err = s * gamma(96) * (x.abs().double() @ q.abs().t())
    bound = dot_err * (1 + 2 * U32) + 2 * U32 * (exact.abs() + linear.bias.double().abs()) + 1e-30
    assert ((y.double() - exact).abs() <= bound).all()


def test_int8_forward_in_bfloat16_rounds_twice() -> None:
    linear = spread_linear(64, 24, seed=2, bias=False)
    layer = Int8Linear.from_linear(linear)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    q, s = layer.qweight.double(), layer.scale.double()
    exact = exact_product(x, q * s[:, None])
    y = layer(x)
    assert y.dtype == torch.bfloat16
    # The product is accumulated in float32, rounded to bfloat16, scaled in float32, rounded again.
    dot_err = s * gamma(64) * (x.abs().double() @ q.abs().t())
    bound = (2 * U16 + U16**2) * (exact.abs() + dot_err) + dot_err
    assert ((y.double() - exact).abs() <= bound).all()


def test_int8_forward_in_float16_does_not_overflow() -> None:
    # Small weights (still float16 normals) and large activations: x @ q.T (3.3e6) is far past
    # float16's range, the output (up to 25.6) is not.
    w = torch.full((4, 256), 1e-3) * torch.tensor([1.0, -1.0, 0.5, 0.25])[:, None]
    q, s = int8_quantize_per_channel(w)
    layer = Int8Linear(q, s)
    x = torch.full((2, 256), 100.0, dtype=torch.float16)
    y = layer(x)
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
    exact = exact_product(x, q.double() * s.double()[:, None])
    # The weight rounded to float16 (u = 2^-11), then a float32-accumulated product rounded once.
    u = 2.0**-11
    bound = (2 * u + gamma(256)) * (x.double().abs() @ (q.double() * s.double()[:, None]).abs().t())
    assert ((y.double() - exact).abs() <= bound).all()


def test_int8_against_the_float_layer_within_the_quantization_error() -> None:
    linear = spread_linear(128, 48, seed=4)
    layer = Int8Linear.from_linear(linear)
    w = linear.weight.double()
    s = layer.scale.double()
    # Per element: round to nearest on a grid of step scale, no value clamped.
    w_err = (w - layer.qweight.double() * s[:, None]).abs()
    assert (w_err <= s[:, None] / 2 * (1 + 1e-6)).all()
    assert (w_err / s[:, None]).max() > 0.45  # the bound is attained, rounding is to nearest
    assert (layer.qweight.abs().amax(dim=1) == 127).all()  # each row's largest value maps to ±127
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(5))
    xa = x.abs().double()
    # |x . (w - q s)| <= (s / 2) sum|x|, plus the float32 rounding of both products.
    bound = (s / 2)[None, :] * xa.sum(dim=1, keepdim=True)
    bound = bound + 2 * gamma(130) * (xa @ w.abs().t() + linear.bias.double().abs())
    err = (layer(x).double() - linear(x).double()).abs()
    assert (err <= bound).all()
    # Per channel matters: the small rows' errors are far below one tensor-wide step.
    small = s < s.max() * 1e-3
    assert small.any() and (err[:, small] < s.max() / 100).all()


def test_int8_rounding_and_edge_rows() -> None:
    w = torch.tensor(
        [
            [127.0, 0.5, 1.5, 2.5, -0.5, -126.5, 63.5, 0.0],  # scale exactly 1: ties go to even
            [0.0] * 8,  # all zero: scale 0, quants 0
            [1000.0, 0.001, -0.003, 3.9, 4.0, -4.0, 0.0, -1000.0],  # one large value dominates
            [-5.0, 2.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # the maximum is negative
        ]
    )
    q, s = int8_quantize_per_channel(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert s[0] == 1.0 and s[1] == 0.0
    assert q[0].tolist() == [127, 0, 2, 2, 0, -126, 64, 0]
    assert q[1].tolist() == [0] * 8
    # scale 1000/127: 3.9 / scale = 0.495 -> 0, 4.0 / scale = 0.508 -> 1; small values flush to 0.
    assert q[2].tolist() == [127, 0, 0, 0, 1, -1, 0, -127]
    assert q[3].tolist() == [-127, 64, 0, 0, 0, 0, 0, 0]  # 2.5 / (5 / 127) = 63.5 -> 64 (even)
    layer = Int8Linear(q, s, bias=torch.full((4,), 0.25))
    out = layer(torch.ones(3, 8))
    assert torch.isfinite(out).all()
    assert (out[:, 1] == 0.25).all()  # a zero row gives the bias alone


def test_int8_shapes_and_dtype_guard() -> None:
    layer = Int8Linear.from_linear(spread_linear(32, 16, seed=6))
    assert layer(torch.randn(2, 3, 32)).shape == (2, 3, 16)
    assert layer(torch.empty(0, 32)).shape == (0, 16)
    assert not any(p.is_floating_point() and p.dtype != torch.float32 for p in layer.parameters())
    with pytest.raises(TypeError, match="keep their dtypes"):
        layer.half()
    assert layer.scale.dtype == torch.float32  # put back as it was
    layer.to("cpu")  # moving is fine
    assert sum(p.numel() for p in layer.parameters()) == 16 * 32 + 16 + 16  # one copy of the weight


# ---------------------------------------------------------------- fp8


def test_e4m3_round_trip_and_per_token_scales() -> None:
    x = torch.tensor(
        [
            [448.0, 17.0, 19.0, 0.3, 232.0, -0.0019, -(2.0**-10), 240.0],
            [224.0, 8.5, 9.5, 0.15, 116.0, -0.00095, -(2.0**-11), 120.0],  # row 0 halved
            [0.0] * 8,
        ]
    )
    q, scale = quantize_activations_fp8(x)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (3, 1)
    assert scale[:, 0].tolist() == [1.0, 0.5, FP8_MIN_SCALE]
    # e4m3 (3 mantissa bits, round to nearest even): 17 -> 16, 19 -> 20, 0.3 -> 0.3125, 232 -> 224;
    # 0.0019 -> 2^-9 (the smallest subnormal), 2^-10 -> 0 (a tie, to even).
    expected = [448.0, 16.0, 20.0, 0.3125, 224.0, -(2.0**-9), 0.0, 240.0]
    assert q[0].float().tolist() == expected
    assert q[1].float().tolist() == expected  # same quants, half the scale
    assert q[2].float().tolist() == [0.0] * 8
    padded, _ = quantize_activations_fp8(x, pad_to=16)
    assert padded.shape == (3, 16) and padded[:, 8:].float().abs().sum() == 0


def hand_layer() -> Fp8Linear:
    w = torch.tensor([[1.0, 0.5, 0.25, -0.125], [3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    linear = nn.Linear(4, 3, bias=True)
    with torch.no_grad():
        linear.weight.copy_(w)
        linear.bias.copy_(torch.tensor([0.0, 1.0, -2.0]))
    return Fp8Linear.from_linear(linear, allow_reference=True)


def test_fp8_reference_against_a_hand_computation() -> None:
    layer = hand_layer()
    assert layer.weight.shape == (16, 16) and layer.weight_scale.shape == (1, 16)  # padded to 16
    assert layer.weight_scale[0, :3].tolist() == pytest.approx([1 / 448, 3 / 448, 0.0], rel=1e-7)
    assert layer.weight_scale[0, 3:].abs().sum() == 0
    # Weight quants: row 0 / (1/448) = [448, 224, 112, -56], all e4m3 values; row 1 -> [448, 0, 0, 0].
    assert layer.weight[0, :4].float().tolist() == [448.0, 224.0, 112.0, -56.0]
    assert layer.weight[1, :4].float().tolist() == [448.0, 0.0, 0.0, 0.0]
    x = torch.tensor([[448.0, 17.0, 19.0, 0.3], [0.0, 0.0, 0.0, 0.0], [-1.0, 1.0, 0.5, 2.0]])
    y = layer(x)
    # Row 0: quants [448, 16, 20, 0.3125], scale 1: 448 + 16/2 + 20/4 - 0.3125/8 = 460.9609375.
    # Row 1: zeros, bias only. Row 2: scale 2/448, quants [-224, 224, 112, 448] exact: x @ w.T.
    expected = torch.tensor([[460.9609375, 1344.0, 0.0], [0.0, 0.0, 0.0], [-0.625, -3.0, 0.0]])
    expected += torch.tensor([0.0, 1.0, -2.0])
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, expected, rtol=4 * U32, atol=0.0)


def test_fp8_scaled_mm_call_matches_the_reference() -> None:
    """The ``torch._scaled_mm`` call (operand layout, row-wise scale shapes, padding) run by torch's
    CPU kernel: equal to the float32 reference but for the bfloat16 output rounding."""
    linear = spread_linear(40, 24, seed=7)  # neither dimension a multiple of 16
    layer = Fp8Linear.from_linear(linear, allow_reference=True)
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(8))
    x[3] = 0.0
    ref = layer.reference_forward(x)
    got = layer.scaled_mm_forward(x)
    assert got.shape == (5, 24) and got.dtype == torch.float32
    assert (got[3] == 0).all()
    xq, xs = quantize_activations_fp8(x)
    mag = (xq.float().abs() @ layer.weight[:24, :40].float().abs().t()) * xs * layer.weight_scale[:, :24]
    assert ((got - ref).abs() <= U16 * ref.abs() + 2 * gamma(40) * mag).all()


def test_fp8_against_the_float_layer_within_the_quantization_error() -> None:
    linear = spread_linear(64, 32, seed=9)
    layer = Fp8Linear.from_linear(linear, allow_reference=True)
    w, w_hat = linear.weight.double(), layer.dequantized_weight().double()
    s_w = layer.weight_scale[0, :32].double()
    # e4m3 rounding: half an ulp, 2^-4 relative for normals, 2^-10 of the scale in the subnormals.
    w_err_bound = torch.maximum(2.0**-4 * w.abs(), 2.0**-10 * s_w[:, None]) * (1 + 1e-6)
    assert ((w - w_hat).abs() <= w_err_bound).all()
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(10)) * torch.logspace(-2, 1, 6)[:, None]
    xq, s_x = quantize_activations_fp8(x)
    x_hat = xq.double() * s_x.double()
    x_err_bound = torch.maximum(2.0**-4 * x.double().abs(), 2.0**-10 * s_x.double())
    assert ((x.double() - x_hat).abs() <= x_err_bound * (1 + 1e-6)).all()
    # |x.w - x^.w^| <= sum |x||w - w^| + |x - x^||w^|, plus float32 rounding.
    bound = x.abs().double() @ w_err_bound.t() + x_err_bound @ w_hat.abs().t()
    bound += 2 * gamma(66) * (x.abs().double() @ w.abs().t() + linear.bias.double().abs()) * 2
    err = (layer(x).double() - linear(x).double()).abs()
    assert (err <= bound).all()
    assert err.max() > 0  # the activations and weights really were quantized


def test_fp8_bfloat16_activations_and_bias() -> None:
    layer = hand_layer()
    x = torch.tensor([[-1.0, 1.0, 0.5, 2.0]], dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    assert y.float().tolist() == [[-0.625, -2.0, -2.0]]


def test_fp8_needs_ada_or_hopper() -> None:
    cpu = torch.device("cpu")
    assert not fp8_supported(cpu)
    with pytest.raises(ValueError, match=r"quantization='fp8' needs a CUDA GPU with compute capability 8\.9"):
        check_fp8_supported(cpu)
    linear = spread_linear(32, 16, seed=11)
    with pytest.raises(ValueError, match="quantization='fp8'"):
        Fp8Linear.from_linear(linear)
    with pytest.raises(ValueError, match="quantization='fp8'"):
        quantize_linears(nn.Sequential(linear), "fp8", cpu)
    # A reference layer moved off its device still computes; one built for a GPU refuses the CPU.
    layer = Fp8Linear.from_linear(linear, allow_reference=True)
    layer.allow_reference = False
    with pytest.raises(ValueError, match="quantization='fp8'"):
        layer(torch.randn(2, 32))


# ---------------------------------------------------------------- Q8_0


def test_q8_0_blocks_round_trip_through_gguf() -> None:
    g = torch.Generator().manual_seed(12)
    w = torch.randn(6, 96, generator=g) * torch.logspace(-4, 1, 6)[:, None]
    w[2] = 0.0
    w[4, 7] = -50.0  # one large value
    blocks = int8_per_channel_q8_0(w)
    assert blocks.dtype == torch.uint8 and blocks.shape == (6, 3 * 34) and blocks.is_contiguous()
    raw = blocks.numpy().reshape(6, 3, 34)
    d = raw[:, :, :2].copy().view("<f2")[..., 0]  # little-endian float16 scales
    assert (d == d[:, :1]).all()  # every block of a row carries the row's scale
    expected_d = (w.abs().amax(dim=1) / 127).to(torch.float16).numpy()
    assert np.array_equal(d[:, 0], expected_d)
    q = raw[:, :, 2:].copy().view(np.int8).reshape(6, 96).astype(np.float32)
    expected_q = np.clip(
        np.round(w.numpy() / np.where(d[:, :1] > 0, d[:, :1], 1).astype(np.float32)), -127, 127
    )
    assert np.array_equal(q, expected_q)
    assert np.abs(q).max(axis=1).tolist() == [127, 127, 0, 127, 127, 127]
    deq = gguf_dequantize(blocks.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert deq.shape == (6, 96)
    assert np.array_equal(deq, q * d[:, :1].astype(np.float32))  # q * scale, bit for bit
    assert (deq[2] == 0).all()
    # Against the float weight: half a step of the float16 scale, or, where that scale rounded down
    # and the row's largest values were clamped to ±127, their excess over 127 steps. Row 0's scale
    # (about 2e-6) is a float16 subnormal, coarse enough for that to happen; the others are normal.
    step = d[:, :1].astype(np.float64)
    wd = np.abs(w.numpy().astype(np.float64))
    err = np.abs(deq - w.numpy().astype(np.float64))
    assert (err <= np.maximum(step / 2, wd - 127 * step) * (1 + 1e-6)).all()
    assert (err[1:] <= step[1:] / 2 * (1 + 1e-6)).all()
    assert err[0].max() > step[0, 0] / 2  # the subnormal scale's row was clamped


def test_q8_0_feeds_the_cpu_quantized_weights() -> None:
    from pagedllm.kernels.cpu.quant import QuantizedWeight, dequantize

    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(13))
    blocks = int8_per_channel_q8_0(w)
    weight = QuantizedWeight("Q8_0", (8, 64), blocks)
    expected = gguf_dequantize(blocks.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(dequantize(weight).numpy(), expected)


def test_q8_0_needs_whole_blocks() -> None:
    with pytest.raises(ValueError, match=r"\(4, 40\)"):
        int8_per_channel_q8_0(torch.randn(4, 40))


# ---------------------------------------------------------------- model-wide swap


def tiny_model(tied: bool) -> LlamaForCausalLM:
    cfg = ModelConfig(
        architecture="qwen2",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=tied,
        attention_bias=True,
    )
    torch.manual_seed(14)
    model = LlamaForCausalLM(cfg, max_position=64)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model.requires_grad_(False)


def test_quantize_linears_swaps_every_projection_and_leaves_a_tied_head() -> None:
    model = tiny_model(tied=True)
    attn = model.layers[0].self_attn
    float_qkv = nn.Linear(32, attn.qkv_proj.out_features)
    float_qkv.load_state_dict(attn.qkv_proj.state_dict())
    assert quantize_linears(model, "int8", "cpu") == 8  # 4 per layer; the tied head stays
    assert not any(isinstance(m, nn.Linear) for m in model.layers.modules())
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.weight is model.embed_tokens.weight
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Int8Linear) and qkv.bias is not None
    x = torch.randn(3, 32)
    bound = (qkv.scale / 2)[None, :] * x.abs().sum(dim=1, keepdim=True) + 1e-3
    assert ((qkv(x) - float_qkv(x)).abs() <= bound).all()
    assert quantize_linears(model, "int8", "cpu") == 0  # nothing left to swap


def test_quantize_linears_tied_head_copy_and_untied_head() -> None:
    model = tiny_model(tied=True)
    table = model.embed_tokens.weight.detach().clone()
    assert quantize_linears(model, "int8", "cpu", quantize_tied=True) == 9
    assert isinstance(model.lm_head, Int8Linear)
    assert torch.equal(model.embed_tokens.weight, table)  # the embedding keeps its float table
    untied = tiny_model(tied=False)
    assert quantize_linears(untied, "int8", torch.device("cpu")) == 9
    with pytest.raises(ValueError, match="quantization='int4'"):
        quantize_linears(untied, "int4", "cpu")
