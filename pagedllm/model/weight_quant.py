"""Weight-only quantized linear layers for the engine argument ``quantization`` (``int8``, ``fp8``).

Both layers replace an ``nn.Linear`` of the model (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``, ``lm_head``): the forward takes ``[tokens, in_features]`` activations in the model
dtype and returns ``[tokens, out_features]`` in that dtype. They hold one copy of each weight, the
quantized one; the float weight is dropped once quantized.

* :class:`Int8Linear`: int8 weights, one float32 scale per output channel (symmetric:
  ``scale = max|w_row| / 127``, ``q = round(w / scale)`` in [-127, 127]). Its effective weight is
  ``q * scale``; the forward is ``x @ (q * scale).T (+ bias)``, computed as ``(x @ q.T) * scale``
  (exact but for the product's rounding, the scale being per output channel).
* :class:`Fp8Linear`: ``float8_e4m3fn`` weights with one float32 scale per output channel
  (``scale = max|w_row| / 448``), activations quantized per token (row) to e4m3 with their own
  float32 scale, the product on Hopper/Ada tensor cores through ``torch._scaled_mm`` with row-wise
  scales. :meth:`Fp8Linear.reference_forward` computes the same math in float32 on any device.
* :func:`int8_per_channel_q8_0`: :class:`Int8Linear`'s quantization as GGUF Q8_0 blocks (every
  block of a row carrying the row's scale) for the CPU's quantized kernels
  (:mod:`pagedllm.kernels.cpu.quant`).
* :func:`quantize_linears`: swaps a model's ``nn.Linear`` layers for quantized ones.

Quantize after the weights are loaded (``load_weights`` copies into ``nn.Linear`` parameters) and
after the model has its dtype: the quantized tensors keep their dtypes, and converting the model to
another dtype afterwards raises (moving it to another device is fine).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

INT8_MAX = 127
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Activation scales are at least this (the smallest normal float32), so that an all-zero row
# quantizes to zeros with a nonzero scale (0 / scale = 0, never 0 / 0) even where subnormals flush.
FP8_MIN_SCALE = float(torch.finfo(torch.float32).tiny)
# torch._scaled_mm needs the reduction dimension and the weight's output dimension to be multiples
# of 16 (the number of tokens is free); Fp8Linear pads its weight with zeros to that.
FP8_ALIGN = 16
# GGUF Q8_0: 32 values per block, stored as a little-endian float16 scale then 32 int8 quants.
Q8_0_BLOCK = 32
Q8_0_BLOCK_BYTES = 2 + Q8_0_BLOCK
# On CUDA, products of at most this many rows use torch._weight_int8pack_mm (where the build has a
# CUDA kernel for it); larger ones dequantize the weight to the activation dtype for cuBLAS. In torch
# 2.13 the CUDA kernel converts the activations to float32 and runs one warp per output element on
# CUDA cores, re-reading the weight for every row, so it can only win for a handful of rows; 0 (off)
# until the quantization benchmark (benchmarks/gpu/sections/quantization.py) shows a crossover.
INT8_PACK_MM_MAX_ROWS = 0
# Rows of a weight quantized at a time, bounding the float32 temporaries (an LM head is large).
_QUANT_CHUNK_ROWS = 4096

QUANTIZED_LINEAR_METHODS = ("int8", "fp8")


def _check_weight(weight: torch.Tensor) -> None:
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"expected a 2-D floating-point weight, got {weight.dtype} {tuple(weight.shape)}")


def _per_channel(
    weight: torch.Tensor, qmax: float, quantize: Callable[[torch.Tensor], torch.Tensor], qdtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``scale[o] = max|weight[o]| / qmax`` (float32), ``q[o] = quantize(w / scale)``
    clamped to ±qmax; an all-zero row gets scale 0 and quants 0. Computed in float32, in chunks of rows."""
    _check_weight(weight)
    out_features = weight.shape[0]
    q = torch.empty(weight.shape, dtype=qdtype, device=weight.device)
    scale = torch.empty(out_features, dtype=torch.float32, device=weight.device)
    for begin in range(0, out_features, _QUANT_CHUNK_ROWS):
        w = weight[begin : begin + _QUANT_CHUNK_ROWS].detach().float()
        s = w.abs().amax(dim=1) / qmax
        safe = torch.where(s > 0, s, torch.ones_like(s))
        q[begin : begin + w.shape[0]] = quantize((w / safe[:, None]).clamp_(-qmax, qmax))
        scale[begin : begin + w.shape[0]] = s
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(f"weight of shape {tuple(weight.shape)} has non-finite values; cannot quantize it")
    return q, scale


def int8_quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: ``(q int8 [out, in], scale float32 [out])`` with
    ``scale = max|w_row| / 127`` and ``q = round(w / scale)`` (half to even) in [-127, 127].
    Every element's error ``|w - q * scale|`` is at most ``scale / 2`` (no value is clamped)."""
    return _per_channel(weight, INT8_MAX, lambda v: torch.round(v).to(torch.int8), torch.int8)


def fp8_quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 per output channel: ``(q float8_e4m3fn [out, in], scale float32 [out])`` with
    ``scale = max|w_row| / 448`` and ``q = e4m3(w / scale)`` (round to nearest even)."""
    return _per_channel(weight, FP8_MAX, lambda v: v.to(FP8_DTYPE), FP8_DTYPE)


def quantize_activations_fp8(x: torch.Tensor, pad_to: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (row) dynamic e4m3 quantization of ``x [tokens, k]``.

    Returns ``(q float8_e4m3fn [tokens, pad_to or k], scale float32 [tokens, 1])`` with
    ``scale = max(max|x_row| / 448, FP8_MIN_SCALE)`` and ``q = e4m3(x_row / scale)``; columns past
    ``k`` (up to ``pad_to``) are zeros. An all-zero row gives zero quants (never NaN). The result is
    the same on every device (float32 division and e4m3 rounding are exactly rounded).
    """
    x32 = x.float()
    if pad_to is not None and pad_to > x32.shape[-1]:
        x32 = F.pad(x32, (0, pad_to - x32.shape[-1]))
    scale = (x32.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_(min=FP8_MIN_SCALE)
    return (x32 / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def int8_per_channel_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` quantized to int8 per output channel, laid out as GGUF Q8_0 blocks.

    Returns a contiguous uint8 CPU tensor ``[out, in / 32 * 34]``: each 32-value block is the
    little-endian float16 scale ``d = float16(max|w_row| / 127)`` followed by 32 int8 quants
    ``q = round(w / float(d))`` clamped to ±127. Every block of a row carries the same ``d``, and the
    quants are computed with the float16-rounded scale, so gguf's dequantization ``d * q`` is exactly
    the quantized weight, within ``d / 2`` of ``w`` except where ``d`` rounded down and the row's
    largest values were clamped to ±127 (off by ``|w| - 127 d`` then). That happens only when ``d`` is
    a float16 subnormal (``max|w_row| < 127 * 2^-14``, about 0.0078), whose rounding is coarse; a
    normal ``d`` is within ``2^-11`` relative, too little for a value to round past 127. An all-zero
    row has ``d = 0`` and zero quants.
    Raises ``ValueError`` when ``in`` is not a multiple of 32 or a scale overflows float16.
    """
    _check_weight(weight)
    out_features, in_features = weight.shape
    if in_features % Q8_0_BLOCK:
        raise ValueError(
            f"Q8_0 needs rows of a multiple of {Q8_0_BLOCK} values; weight of shape "
            f"{tuple(weight.shape)} has {in_features}"
        )
    w = weight.detach().to(device="cpu", dtype=torch.float32)
    d16 = (w.abs().amax(dim=1) / INT8_MAX).to(torch.float16)
    if not bool(torch.isfinite(d16).all()):
        raise ValueError(f"weight of shape {tuple(weight.shape)} has a row scale beyond float16's range")
    d = d16.float()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(w / safe[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    bits = d16.view(torch.int16).to(torch.int32) & 0xFFFF
    d_bytes = torch.stack((bits & 0xFF, bits >> 8), dim=1).to(torch.uint8)  # little-endian
    nblocks = in_features // Q8_0_BLOCK
    blocks = torch.empty(out_features, nblocks, Q8_0_BLOCK_BYTES, dtype=torch.uint8)
    blocks[:, :, :2] = d_bytes[:, None, :]
    blocks[:, :, 2:] = q.view(torch.uint8).view(out_features, nblocks, Q8_0_BLOCK)
    return blocks.view(out_features, nblocks * Q8_0_BLOCK_BYTES)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return major, minor


def fp8_supported(device: torch.device | str) -> bool:
    """Whether ``torch._scaled_mm`` runs e4m3 products on ``device``: CUDA with compute capability
    8.9 or newer (Ada, Hopper and later)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= (8, 9)


def check_fp8_supported(device: torch.device | str) -> None:
    """Raise ``ValueError`` (naming the ``quantization`` field) unless ``device`` runs FP8 products."""
    if fp8_supported(device):
        return
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = _capability(index)
        found = f"{device} has compute capability {major}.{minor}"
    else:
        found = f"the device is {device}"
    raise ValueError(
        "quantization='fp8' needs a CUDA GPU with compute capability 8.9 or newer (Ada/Hopper); "
        f"{found}. Use quantization='int8' (any device) or 'none'."
    )


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _on_device(
    linear: nn.Linear, device: torch.device | str | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``linear``'s weight and bias (detached) on ``device`` (copies only when elsewhere)."""
    weight, bias = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
    if device is None:
        return weight, bias
    return weight.to(device), None if bias is None else bias.to(device)


class _QuantizedLinear(nn.Module):
    """What the quantized layers share: shapes, bias, and dtypes that model conversions keep.

    The quantized tensors are parameters (``requires_grad=False``) so that weight counts and sizes
    taken over ``model.parameters()`` include them. ``bias`` (or None) is ``[out_features]`` in the
    model dtype and follows dtype conversions; the tensors named in ``_fixed_dtype`` do not:
    converting them (``model.half()``, ``.to(dtype)``) raises ``TypeError``.
    """

    _fixed_dtype: tuple[str, ...] = ()

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ValueError(f"bias of shape {tuple(bias.shape)} for {out_features} outputs")
        self.bias = None if bias is None else _frozen(bias.detach())

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        before = {name: getattr(self, name).data for name in self._fixed_dtype}
        result = super()._apply(fn, recurse)
        changed = [name for name in self._fixed_dtype if getattr(self, name).dtype != before[name].dtype]
        if changed:
            for name in self._fixed_dtype:  # put the quantized tensors back as they were
                getattr(self, name).data = before[name]
            raise TypeError(
                f"{type(self).__name__}: {', '.join(changed)} keep their dtypes; convert the model "
                "before quantizing it (moving it between devices is fine)"
            )
        return result

    def _finish(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Add the bias to the ``[rows, out]`` product and give it ``x``'s leading dimensions."""
        if self.bias is not None:
            y = y.add_(self.bias) if y.is_contiguous() else y + self.bias
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


class Int8Linear(_QuantizedLinear):
    """Weight-only int8 linear layer, one scale per output channel.

    Attributes: ``qweight`` int8 ``[out, in]``, ``scale`` float32 ``[out]`` (the effective weight is
    ``qweight * scale[:, None]``; ``scale`` 0 and quants 0 for an all-zero row), ``bias`` or None,
    ``in_features``, ``out_features``. The forward returns ``x @ (qweight * scale).T + bias`` in
    ``x``'s dtype, computed as ``(x @ qweight.T)`` rounded to that dtype, times ``scale`` in float32,
    rounded again (so within two roundings of the dtype of the exact product with the effective
    weight); for float16, whose range the unscaled product can exceed, as ``x`` times the effective
    weight rounded to float16. A row's result does not depend on the other rows.
    """

    _fixed_dtype = ("qweight", "scale")

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(
                f"Int8Linear takes a 2-D int8 weight, got {qweight.dtype} {tuple(qweight.shape)}"
            )
        if scale.dtype != torch.float32 or tuple(scale.shape) != (qweight.shape[0],):
            raise ValueError(
                f"Int8Linear takes float32 scales [{qweight.shape[0]}], got {tuple(scale.shape)}"
            )
        super().__init__(qweight.shape[1], qweight.shape[0], bias)
        self.qweight = _frozen(qweight.contiguous())
        self.scale = _frozen(scale.contiguous())

    @classmethod
    def from_linear(cls, linear: nn.Linear, device: torch.device | str | None = None) -> Int8Linear:
        """Quantize ``linear``'s weight on ``device`` (default: the weight's), leaving ``linear`` as it
        is; the new layer keeps no float weight."""
        weight, bias = _on_device(linear, device)
        q, scale = int8_quantize_per_channel(weight)
        return cls(q, scale, bias)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The effective weight ``qweight * scale`` ``[out, in]``: the product rounded once to float32,
        then cast to ``dtype`` (for exact values, multiply in float64)."""
        return (self.qweight.float() * self.scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if x2.is_cuda and 0 < x2.shape[0] <= INT8_PACK_MM_MAX_ROWS and _cuda_int8pack_mm():
            y = torch._weight_int8pack_mm(x2, self.qweight, self.scale)
        elif x2.dtype == torch.float16:
            # Unscaled, x @ q.T is 1 / scale times the output and overflows float16's 65504: multiply
            # by the weight scaled first (q * scale computed in float32, rounded once to float16;
            # values below float16's normals, 6.1e-5, are coarser, as in a float16 checkpoint).
            y = F.linear(x2, self.qweight.to(torch.float16).mul_(self.scale[:, None]))
        else:
            # Quants up to 127 are exact in float16/bfloat16; the in-place multiply by the float32
            # scale computes in float32 and rounds once to x's dtype.
            y = F.linear(x2, self.qweight.to(x2.dtype)).mul_(self.scale)
        return self._finish(y, x)


@functools.cache
def _cuda_int8pack_mm() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm", "CUDA")


class Fp8Linear(_QuantizedLinear):
    """FP8 (e4m3) linear layer: weights per output channel, activations per token.

    Attributes: ``weight`` float8_e4m3fn ``[out_p, in_p]`` (row-major; ``out_p``/``in_p`` are
    ``out_features``/``in_features`` rounded up to :data:`FP8_ALIGN`, the padding zeros),
    ``weight_scale`` float32 ``[1, out_p]`` (the effective weight is ``weight * weight_scale.T``;
    padding columns have scale 0), ``bias`` or None, ``in_features``, ``out_features``,
    ``use_fast_accum`` (False: ``_scaled_mm``'s exact float32 accumulation), ``allow_reference``.

    The forward quantizes ``x`` per token (:func:`quantize_activations_fp8`), multiplies the e4m3
    operands with float32 accumulation, scales the result by ``scale_x[t] * weight_scale[o]``, adds
    the bias and returns ``x``'s dtype. On CUDA with compute capability 8.9+ that is one
    ``torch._scaled_mm`` call with row-wise scales and a bfloat16 output (the only output type its
    CUTLASS row-wise path accepts; a float16/float32 model gets that output cast, a rounding far finer
    than e4m3's). Elsewhere it is :meth:`reference_forward` when the layer was built with
    ``allow_reference=True`` (tests), and a ``ValueError`` naming ``quantization`` otherwise.
    """

    _fixed_dtype = ("weight", "weight_scale")
    use_fast_accum: bool = False

    def __init__(
        self,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        allow_reference: bool = False,
    ) -> None:
        """``qweight`` e4m3 ``[out, in]`` and ``scale`` float32 ``[out]`` (unpadded); raises
        ``ValueError`` unless the weight's device runs FP8 products or ``allow_reference``."""
        if qweight.dtype != FP8_DTYPE or qweight.dim() != 2:
            raise ValueError(
                f"Fp8Linear takes a 2-D {FP8_DTYPE} weight, got {qweight.dtype} {tuple(qweight.shape)}"
            )
        if scale.dtype != torch.float32 or tuple(scale.shape) != (qweight.shape[0],):
            raise ValueError(f"Fp8Linear takes float32 scales [{qweight.shape[0]}], got {tuple(scale.shape)}")
        if not allow_reference:
            check_fp8_supported(qweight.device)
        out_features, in_features = qweight.shape
        super().__init__(in_features, out_features, bias)
        self.allow_reference = allow_reference
        out_p, in_p = _round_up(out_features, FP8_ALIGN), _round_up(in_features, FP8_ALIGN)
        if (out_p, in_p) != (out_features, in_features):
            padded = torch.zeros(out_p, in_p, dtype=torch.uint8, device=qweight.device)
            padded[:out_features, :in_features] = qweight.view(torch.uint8)  # e4m3 +0 is all zero bits
            qweight = padded.view(FP8_DTYPE)
            scale = F.pad(scale, (0, out_p - out_features))
        self.weight = _frozen(qweight.contiguous())
        self.weight_scale = _frozen(scale.reshape(1, out_p).contiguous())

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, device: torch.device | str | None = None, *, allow_reference: bool = False
    ) -> Fp8Linear:
        """Quantize ``linear``'s weight on ``device`` (default: the weight's), leaving ``linear`` as it
        is; the new layer keeps no float weight."""
        if not allow_reference:
            check_fp8_supported(linear.weight.device if device is None else device)
        weight, bias = _on_device(linear, device)
        q, scale = fp8_quantize_per_channel(weight)
        return cls(q, scale, bias, allow_reference=allow_reference)

    def dequantized_weight(self) -> torch.Tensor:
        """The effective weight ``[out, in]`` in float32 (exact: e4m3 values have 4 significant bits)."""
        w = self.weight[: self.out_features, : self.in_features].float()
        return w * self.weight_scale[0, : self.out_features, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if x2.is_cuda and fp8_supported(x2.device):
            return self._finish(self.scaled_mm_forward(x2), x)
        if not self.allow_reference:
            check_fp8_supported(x2.device)
        return self._finish(self.reference_forward(x2), x)

    def scaled_mm_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The product of ``x [tokens, in]`` by the effective weight through ``torch._scaled_mm``
        (row-wise scales, bfloat16 output), cast to ``x``'s dtype; no bias. Runs on capable CUDA
        devices, and on the CPU (torch's oneDNN kernel, for tests of the call)."""
        out_p, in_p = self.weight.shape
        xq, x_scale = quantize_activations_fp8(x, pad_to=in_p)
        y = torch._scaled_mm(
            xq,
            self.weight.t(),  # [in_p, out_p], column-major as _scaled_mm requires of its second operand
            scale_a=x_scale,  # [tokens, 1] float32, contiguous
            scale_b=self.weight_scale,  # [1, out_p] float32, contiguous
            out_dtype=torch.bfloat16,
            use_fast_accum=self.use_fast_accum,
        )
        if out_p != self.out_features:
            y = y[:, : self.out_features]
        return y.to(x.dtype) if x.dtype != y.dtype else y.contiguous()

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The same product in float32 on any device, cast to ``x``'s dtype; no bias:
        ``((e4m3(x / s_x) @ weight.T) * s_x) * weight_scale`` with ``s_x`` per row."""
        xq, x_scale = quantize_activations_fp8(x)
        w = self.weight[: self.out_features, : self.in_features].float()
        y = (xq.float() @ w.t()) * x_scale * self.weight_scale[:, : self.out_features]
        return y.to(x.dtype)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def quantize_linears(
    model: nn.Module, method: str, device: torch.device | str, *, quantize_tied: bool = False
) -> int:
    """Replace every ``nn.Linear`` of ``model`` by an :class:`Int8Linear` (``method="int8"``) or an
    :class:`Fp8Linear` (``"fp8"``) on ``device``; returns how many were replaced.

    Each linear's weight is quantized on ``device`` (copied there first when elsewhere), and the
    float layer is dropped as soon as its replacement is in place (its weight is freed unless
    something else holds it), so the peak stays about one float layer above the final size. A linear whose weight is shared
    with another module (a tied LM head, which shares ``embed_tokens``' table) is left in the model
    dtype, unless ``quantize_tied``: then the head gets a quantized copy and the embedding keeps the
    float table. Only ``nn.Linear`` instances are replaced (not CPU panel layers or layers already
    quantized). Call it after the weights are loaded. Raises ``ValueError`` naming ``quantization``
    for an unknown method, or for ``fp8`` on a device that cannot run FP8 products.
    """
    if method not in QUANTIZED_LINEAR_METHODS:
        raise ValueError(
            f"quantization={method!r} has no quantized linear layers (choose {', '.join(QUANTIZED_LINEAR_METHODS)})"
        )
    device = torch.device(device)
    if method == "fp8":
        check_fp8_supported(device)
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    # (parent, attribute) pairs only: holding the linears here would keep every float weight alive.
    targets = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    swapped = 0
    for parent, name in targets:
        linear = getattr(parent, name)
        if uses[id(linear.weight)] > 1 and not quantize_tied:
            continue
        with torch.no_grad():
            new: nn.Module = (
                Int8Linear.from_linear(linear, device)
                if method == "int8"
                else Fp8Linear.from_linear(linear, device)
            )
        setattr(parent, name, new)
        del linear
        swapped += 1
    return swapped
