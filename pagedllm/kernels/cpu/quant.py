"""Matrix products with GGUF-quantized weights in their own block layout (llama.cpp-style), on the CPU.

A :class:`QuantizedWeight` holds a weight exactly as a GGUF file stores it (the raw uint8 blocks of
each output row, as ``gguf.GGUFReader`` returns them; no float copy). :func:`quant_matmul` multiplies
float32 activations by it in the kernel library (``pagedllm/kernels/csrc/quant_cpu.c``): the
activations are quantized to int8 per block (one scale per 32 values, per 256 for the K types), then
integer dot products run on the stored quants (AVX-512 VNNI, AVX2 or portable C, whichever the
library was compiled for), so the weight is read at its stored size (about 4.5-8.5 bits a value). The
result differs from the float product by the activations' rounding, at most half an int8 step per
value (see the tests for the bound). With ``amx=True``, where the CPU has AMX (:func:`amx_enabled`:
on by default, ``PAGEDLLM_CPU_AMX=0`` turns it off), the product runs instead on its bfloat16 tiles
(``quant_amx_cpu.c``): a few output columns of the weight at a time are dequantized into a per-thread
scratch panel, so that no float copy of the weight outlives the call; x and the weight are rounded to
bfloat16 and the products summed in float32. The engine takes the tiles for prompt tokens and the
integer kernels for every other row, whatever the batch (:mod:`pagedllm.kernels.cpu.row_paths`).
:func:`dequantize` expands rows to float32, bitwise as ``gguf.quants.dequantize`` does.

Where the kernel library cannot be built, both fall back to gguf's NumPy dequantizer (and
``F.linear``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.kernels.cpu.library import kernels_available, load_library

# GGML type name: (type id, values per block, bytes per block).
_TYPES: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
}
SUPPORTED_TYPES: tuple[str, ...] = tuple(_TYPES)

# GGUF types without kernels of their own that load, losslessly, as a kernel type: a Q5_0 block's
# 5-bit quants (-16..15) and f16 scale are a Q8_0 block's (34 bytes instead of 22).
REPACKED_TYPES: dict[str, str] = {"Q5_0": "Q8_0"}
# Every GGUF type :meth:`QuantizedWeight.from_gguf` takes.
LOADABLE_TYPES: tuple[str, ...] = SUPPORTED_TYPES + tuple(REPACKED_TYPES)

_ISA_NAMES = {0: "portable C", 1: "AVX2", 2: "AVX2 + AVX-VNNI", 3: "AVX-512 VNNI"}

# The environment variable that turns the AMX path off ("0"); "1" (or unset) leaves it on where it runs.
AMX_ENV = "PAGEDLLM_CPU_AMX"


def check_supported(type_name: str) -> None:
    """Raise ``ValueError`` naming ``type_name`` unless the kernels handle that GGUF type."""
    if type_name not in _TYPES:
        raise ValueError(
            f"GGUF quantization type {type_name} is not supported by the quantized CPU kernels "
            f"(supported: {', '.join(SUPPORTED_TYPES)})."
        )


def block_size(type_name: str) -> int:
    """Values per block of a supported type (32, or 256 for the K types)."""
    check_supported(type_name)
    return _TYPES[type_name][1]


def row_bytes(type_name: str, in_features: int) -> int:
    """Bytes of one weight row of ``in_features`` values (a multiple of the block size)."""
    check_supported(type_name)
    _, values, nbytes = _TYPES[type_name]
    if in_features % values:
        raise ValueError(f"{type_name} rows hold a multiple of {values} values, not {in_features}.")
    return in_features // values * nbytes


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A linear layer's weight ``[out_features, in_features]`` in GGUF blocks.

    ``blocks`` is a contiguous uint8 CPU tensor ``[out_features, row_bytes]``: row ``o`` is the
    ``in_features / block_size`` blocks of output ``o``, in the type's GGUF layout.
    """

    type_name: str
    shape: tuple[int, int]
    blocks: torch.Tensor

    def __post_init__(self) -> None:
        check_supported(self.type_name)
        out_features, in_features = self.shape
        expected = (out_features, row_bytes(self.type_name, in_features))
        if self.blocks.dtype != torch.uint8 or self.blocks.device.type != "cpu":
            raise ValueError("QuantizedWeight.blocks must be a uint8 CPU tensor.")
        if tuple(self.blocks.shape) != expected or not self.blocks.is_contiguous():
            raise ValueError(
                f"{self.type_name} weight of shape {self.shape} needs contiguous blocks of shape {expected}, "
                f"got {tuple(self.blocks.shape)}."
            )

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def type_id(self) -> int:
        return _TYPES[self.type_name][0]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    @classmethod
    def from_gguf(cls, tensor: Any) -> QuantizedWeight:
        """From a ``gguf.ReaderTensor``: its blocks as they lie in the file's memory map (no copy; the
        mapping is read-only and stays open while the weight lives).

        A type of :data:`REPACKED_TYPES` comes back as its kernel type, with the same values (a copy)."""
        type_name = tensor.tensor_type.name
        dims = [int(v) for v in tensor.shape]  # GGUF lists the row length (ne0) first
        in_features, out_features = dims[0], math.prod(dims[1:])
        if type_name == "Q5_0":
            data = q5_0_to_q8_0(np.asarray(tensor.data, dtype=np.uint8).reshape(out_features, -1))
            return cls("Q8_0", (out_features, in_features), torch.from_numpy(data))
        check_supported(type_name)
        return cls(type_name, (out_features, in_features), mapped_bytes(tensor.data).view(out_features, -1))


def mapped_bytes(array: np.ndarray) -> torch.Tensor:
    """A uint8 tensor over the bytes of ``array`` (a read-only view of a file mapping), without a copy.

    torch has no read-only tensors; nothing in pagedllm writes into a weight's blocks (a write would
    fault), so the warning torch gives for a read-only array is not shown."""
    flat = np.asarray(array).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(flat)


def q5_0_to_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q5_0 rows ``[rows, 22 * n]`` (uint8) as Q8_0 rows ``[rows, 34 * n]`` of the same values.

    A Q5_0 block is an f16 scale ``d``, 32 high bits ``qh`` (little-endian) and 16 bytes of nibbles;
    value ``j < 16`` is ``d * ((qs[j] & 15 | bit j of qh << 4) - 16)``, value ``j + 16`` takes the high
    nibble and bit ``j + 16``. The Q8_0 block keeps ``d`` and stores the 32 integers as int8, so
    ``gguf.quants.dequantize`` gives the same float32 values bit for bit.
    """
    rows = blocks.shape[0]
    b = np.ascontiguousarray(blocks).reshape(-1, 22)
    qh = b[:, 2:6].copy().view("<u4")  # [n, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4  # [n, 32]
    qs = b[:, 6:22]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # [n, 32]
    out = np.empty((b.shape[0], 34), dtype=np.uint8)
    out[:, :2] = b[:, :2]
    out[:, 2:] = ((low | high).astype(np.int16) - 16).astype(np.int8).view(np.uint8)
    return out.reshape(rows, -1)


def kernel_isa() -> str:
    """The instruction set :func:`quant_matmul` uses here (``"portable C"`` without the library), and
    ``" + AMX-BF16"`` where prompt rows run on the tile units (:func:`amx_enabled`)."""
    if not kernels_available():
        return "portable C"
    name = _ISA_NAMES.get(int(load_library().quant_kernel_isa()), "unknown")
    return name + " + AMX-BF16" if amx_enabled() else name


@functools.cache
def amx_available() -> bool:
    """Whether the AMX path runs here: the library was compiled for AMX-BF16 and Linux grants the
    tile data to this process (asked once)."""
    return kernels_available() and bool(load_library().amx_quant_available())


def amx_enabled() -> bool:
    """Whether prompt rows take the AMX tiles: where they run (:func:`amx_available`) unless
    ``PAGEDLLM_CPU_AMX=0``. The engine chooses the path per token, never per batch size
    (:mod:`pagedllm.kernels.cpu.row_paths`), so a token's result does not depend on its batch.

    Raises ``ValueError`` naming the variable for a value other than ``0`` or ``1``."""
    value = os.environ.get(AMX_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(
            f"{AMX_ENV} must be 0 (integer kernels only) or 1 (AMX tiles for prompts), not {value!r}."
        )
    return value == "1" and amx_available()


def _check_rc(rc: int, weight: QuantizedWeight) -> None:
    if rc == -3:
        raise MemoryError("quant_matmul: out of memory for the quantized activations.")
    if rc:
        raise ValueError(
            f"quantized kernel rejected a {weight.type_name} weight of shape {weight.shape} (code {rc})."
        )


def _dequantize_numpy(weight: QuantizedWeight, begin: int, end: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    values = gguf_dequantize(weight.blocks[begin:end].numpy(), GGMLQuantizationType[weight.type_name])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def dequantize(weight: QuantizedWeight, rows: slice | None = None) -> torch.Tensor:
    """Rows ``rows`` (a step-1 slice of the output rows; all by default) of ``weight`` as a float32
    tensor ``[len(rows), in_features]``, equal bit for bit to ``gguf.quants.dequantize``."""
    begin, end, step = (rows or slice(None)).indices(weight.out_features)
    if step != 1:
        raise ValueError("dequantize takes a contiguous range of rows (a slice with step 1).")
    end = max(begin, end)
    if not kernels_available():
        return _dequantize_numpy(weight, begin, end)
    out = torch.empty(end - begin, weight.in_features, dtype=torch.float32)
    rc = load_library().quant_dequantize_f32(
        weight.type_id, weight.blocks.data_ptr(), begin, end, weight.in_features, out.data_ptr()
    )
    _check_rc(rc, weight)
    return out


def gather_rows(weight: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (any shape of int64 row indices) of ``weight`` as float32 ``[*ids.shape, in_features]``,
    bitwise as :func:`dequantize` gives them: an embedding lookup on a quantized table."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    n = weight.out_features
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
        raise IndexError(f"row ids must be in [0, {n}).")
    if not kernels_available():
        table = _dequantize_numpy(weight, 0, n)
        return table[flat].view(*ids.shape, weight.in_features)
    out = torch.empty(flat.numel(), weight.in_features, dtype=torch.float32)
    rc = load_library().quant_gather_rows_f32(
        weight.type_id,
        weight.blocks.data_ptr(),
        flat.data_ptr(),
        flat.numel(),
        weight.in_features,
        out.data_ptr(),
    )
    _check_rc(rc, weight)
    return out.view(*ids.shape, weight.in_features)


def quant_matmul(
    x: torch.Tensor,
    weight: QuantizedWeight,
    *,
    out: torch.Tensor | None = None,
    portable: bool = False,
    amx: bool = False,
) -> torch.Tensor:
    """``x @ W.T`` for float32 ``x [..., in_features]`` and a quantized ``W``: float32 ``[..., out_features]``.

    ``out`` (optional) is a float32 ``[rows, out_features]`` view with unit column stride to write into
    (a column range of a wider output); it is returned. ``portable=True`` takes the kernel's portable C
    path whatever the CPU (for tests). ``amx=True`` runs the product on the AMX tiles (``RuntimeError``
    where :func:`amx_available` is false): x and the weight rounded to bfloat16, summed in float32.
    On either path a row's result does not depend on the other rows of ``x`` (how many, or where the
    row lies) nor on the thread count; the two paths round differently (the integer path quantizes x
    to int8), so callers choose the path per row (:mod:`pagedllm.kernels.cpu.row_paths`).
    """
    k, n = weight.in_features, weight.out_features
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise TypeError(f"quant_matmul takes float32 CPU inputs, got {x.dtype} on {x.device}.")
    if x.shape[-1] != k:
        raise ValueError(f"quant_matmul: input has {x.shape[-1]} features, the weight {k}.")
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    rows = x2.shape[0]
    if out is not None and (
        out.dtype != torch.float32
        or tuple(out.shape) != (rows, n)
        or out.stride(-1) != 1
        or out.stride(0) < n
    ):
        raise ValueError(f"quant_matmul: out must be a float32 [{rows}, {n}] view with unit column stride.")
    if not kernels_available():
        result = F.linear(x2, _dequantize_numpy(weight, 0, n))
        if out is None:
            return result if x.dim() == 2 else result.view(*x.shape[:-1], n)
        return out.copy_(result)
    if x2.stride(-1) != 1 or (rows > 1 and x2.stride(0) < k):
        x2 = x2.contiguous()
    y = torch.empty(rows, n, dtype=torch.float32) if out is None else out
    lib = load_library()
    if amx and (portable or not amx_available()):
        raise RuntimeError("quant_matmul: amx=True needs the AMX path (not portable, an AMX-BF16 CPU).")
    if amx:
        fn = lib.amx_quant_matmul_f32
    else:
        fn = lib.quant_matmul_f32_portable if portable else lib.quant_matmul_f32
    rc = fn(
        weight.type_id,
        weight.blocks.data_ptr(),
        n,
        k,
        x2.data_ptr(),
        rows,
        x2.stride(0),
        y.data_ptr(),
        y.stride(0),
    )
    _check_rc(rc, weight)
    if out is not None or x.dim() == 2:
        return y
    return y.view(*x.shape[:-1], n)
