"""The GGUF-quantized products and dequantizers (``pagedllm/kernels/csrc/quant_cpu.c`` through
:mod:`pagedllm.kernels.cpu.quant`) against gguf's NumPy reference, on every path the C file has.

Tolerance. The kernels quantize each row of x to int8 per block (``d = max|x| / 127`` over the 32
values of a Q4_0 / Q4_1 / Q8_0 block, the 256 of a K block; ``q = round(x / d)``) and then compute
exactly in integers, scaling in float32. So against the product of the dequantized weight with the
unquantized x (in float64), the error of output ``(r, o)`` is bounded by

    sum_i |W[o, i]| * d(r, i) / 2          (each x rounded by at most half a step of its block)

plus float32 rounding of the scaled sums, which ``_float_slack`` bounds generously (1e-5 of the sum
of the magnitudes the kernel adds, a hundred times what float32 rounding can reach and still a
hundredth of the bound above). That is the stated guarantee, checked first. A tighter check follows:
against the product with x quantized in NumPy as the kernel specifies, the only differences allowed
are float rounding and a quant that may round the other way where ``x / d`` lies within 1e-3 of a
half-integer (where the kernel's float32 arithmetic and NumPy's may disagree); any mistake in a
block's scale, offset or bit layout shows there at once.
"""

from __future__ import annotations

import ctypes
import functools
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from helpers.quant_weights import random_weight
from pagedllm.kernels.cpu import library
from pagedllm.kernels.cpu.library import kernels_available, load_library
from pagedllm.kernels.cpu.quant import (
    SUPPORTED_TYPES,
    QuantizedWeight,
    amx_enabled,
    block_size,
    check_supported,
    dequantize,
    kernel_isa,
    quant_matmul,
)
from pagedllm.model.loader import default_model_path

needs_kernels = pytest.mark.skipif(not kernels_available(), reason="no C compiler for the CPU kernels")

SOURCE = Path(library.__file__).parent.parent / "csrc" / "quant_cpu.c"


def random_input(rows: int, in_features: int, block: int, seed: int) -> torch.Tensor:
    """Rows of x with some awkward blocks: one all zero, one with a single large value."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen)
    if in_features >= 2 * block:
        x[::2, :block] = 0.0
        x[1::3, block + 3] = 40.0
    return x


def activation_steps(x: np.ndarray, block: int) -> np.ndarray:
    """The int8 step d of each value's block, as the kernel computes it (float32), as float64."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // block, block)
    d = np.abs(blocks).max(axis=-1, keepdims=True) * np.float32(1.0 / 127.0)
    return np.broadcast_to(d, blocks.shape).reshape(rows, k).astype(np.float64)


def simulated_activations(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """x as the kernel quantizes it (d * round(x * (127 / max|x|)), float32 steps) in float64, and
    where a quant may round either way (x / d within 1e-3 of a half-integer)."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // block, block)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        scale = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    scaled = blocks * scale
    quants = np.rint(scaled)
    tie = np.abs(np.abs(scaled - np.floor(scaled)) - 0.5) < 1e-3
    d = amax * np.float32(1.0 / 127.0)
    return (quants.astype(np.float64) * d).reshape(rows, k), tie.reshape(rows, k)


def _float_slack(w: np.ndarray, x: np.ndarray, block: int) -> np.ndarray:
    """1e-5 of the magnitudes the kernel sums: per value |W| plus up to four times its block's
    largest |W| (the block offsets: 8d for Q4_0, m for Q4_1, 128d for Q8_0, dmin * min for the K
    types, all added and taken out again), times |x| (at most 1 + 1/254 times its quantized value)."""
    rows_w, k = w.shape
    peak = np.abs(w).reshape(rows_w, k // 32, 32).max(axis=-1, keepdims=True)
    magnitude = np.abs(w) + 4 * np.broadcast_to(peak, (rows_w, k // 32, 32)).reshape(rows_w, k)
    return 1e-5 * (np.abs(x).astype(np.float64) @ magnitude.T) + 1e-30


def assert_product_close(y: torch.Tensor, x: torch.Tensor, w: np.ndarray, type_name: str) -> None:
    """``y`` against x @ w.T within the bounds in this module's docstring."""
    block = block_size(type_name)
    xn = x.numpy()
    w64 = w.astype(np.float64)
    got = y.numpy().astype(np.float64)
    slack = _float_slack(w, xn, block)
    # The guarantee: half an int8 step per value of x, against the unquantized x.
    bound = 0.5 * (1 + 1e-3) * (activation_steps(xn, block) @ np.abs(w64).T) + slack
    err = np.abs(got - xn.astype(np.float64) @ w64.T)
    assert (err <= bound).all(), f"{type_name}: error {err.max():.3e} over the activation-rounding bound"
    # Tight: x quantized as the kernel does; only float rounding and near-tie quants may differ.
    simulated, tie = simulated_activations(xn, block)
    tight = (tie * activation_steps(xn, block)) @ np.abs(w64).T + slack
    err = np.abs(got - simulated @ w64.T)
    worst = np.unravel_index(np.argmax(err / tight), err.shape)
    assert (err <= tight).all(), f"{type_name}: error {err[worst]:.3e} > {tight[worst]:.3e} at {worst}"


# (out_features, in_features) with odd counts of rows and blocks: one block, an odd number of
# blocks, 1 and 5 output rows (AVX2 tiles take up to 4 columns, AVX-512 groups 16).
SHAPES_32 = [(5, 32), (67, 96), (33, 288)]
SHAPES_K = [(5, 256), (37, 768), (1, 512)]


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 7, 32, 300])
@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_matmul_matches_reference(type_name: str, rows: int) -> None:
    shapes = SHAPES_32 if block_size(type_name) == 32 else SHAPES_K
    for i, (n, k) in enumerate(shapes):
        weight, w = random_weight(type_name, n, k, seed=10 * rows + i)
        x = random_input(rows, k, block_size(type_name), seed=rows + i)
        simd = quant_matmul(x, weight, amx=False)  # (the AMX path: test_quant_amx.py)
        portable = quant_matmul(x, weight, portable=True)
        assert simd.shape == (rows, n) and simd.dtype == torch.float32
        assert_product_close(simd, x, w, type_name)
        assert_product_close(portable, x, w, type_name)
        # The two paths differ by float rounding only.
        slack = torch.from_numpy(2 * _float_slack(w, x.numpy(), block_size(type_name))).float()
        assert ((simd - portable).abs() <= slack).all()


@needs_kernels
@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_rows_are_independent(type_name: str) -> None:
    """On the integer path, row i's output is bitwise the same alone, in any batch and with any number of
    threads (the AMX path, which prompt tokens take by default: test_quant_amx.py)."""
    block = block_size(type_name)
    weight, _ = random_weight(type_name, 37, 3 * block, seed=5)
    x = random_input(300, 3 * block, block, seed=6)
    batch = quant_matmul(x, weight, amx=False)
    alone = torch.cat([quant_matmul(x[i : i + 1], weight, amx=False) for i in range(300)])
    assert torch.equal(batch, alone)
    assert torch.equal(quant_matmul(x[5:12], weight, amx=False), batch[5:12])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = quant_matmul(x, weight, amx=False)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, batch)
    # The portable path too.
    portable = quant_matmul(x, weight, portable=True)
    assert torch.equal(torch.cat([quant_matmul(x[i : i + 1], weight, portable=True) for i in (0, 7, 299)]),
                       portable[[0, 7, 299]])  # fmt: skip


# The AVX-512 path of the 32-value types works on groups of 16 output columns (weight rows), the last
# one partial (masked) when n is not a multiple of 16, the threads splitting whole groups, and takes
# up to 12 rows of x with the weight decoded on the way, more in tiles of rows over a decoded copy.
SHAPES_16 = [(1, 32), (5, 32), (15, 96), (16, 32), (17, 288), (47, 160), (64, 64), (100, 32)]


@needs_kernels
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_column_groups(type_name: str) -> None:
    """n below, at and past multiples of 16, one block, odd block counts; 1 to 300 rows (each tile
    size of rows and both sides of 12 rows); each row bitwise the same alone and with 1 to 3 threads."""
    all_rows = [*range(1, 15), 24, 25, 37, 300]
    for i, (n, k) in enumerate(SHAPES_16):
        weight, w = random_weight(type_name, n, k, seed=100 + i)
        x = random_input(300, k, 32, seed=200 + i)
        full = quant_matmul(x, weight, amx=False)
        assert_product_close(full, x, w, type_name)
        for rows in all_rows:
            assert torch.equal(quant_matmul(x[:rows], weight, amx=False), full[:rows]), (n, k, rows)
        assert torch.equal(quant_matmul(x[299:], weight, amx=False), full[299:])
        threads = torch.get_num_threads()
        try:
            for count in (1, 3):
                torch.set_num_threads(count)
                assert torch.equal(quant_matmul(x, weight, amx=False), full), (n, k, count)
                assert torch.equal(quant_matmul(x[:5], weight, amx=False), full[:5]), (n, k, count)
        finally:
            torch.set_num_threads(threads)


@needs_kernels
def test_strided_and_batched_inputs() -> None:
    weight, w = random_weight("Q4_1", 40, 96, seed=1)
    wide = torch.randn(9, 200)
    x = wide[:, 50:146]  # row stride 200
    assert_product_close(quant_matmul(x, weight), x.contiguous(), w, "Q4_1")
    x3 = torch.randn(2, 3, 96)
    y3 = quant_matmul(x3, weight)
    assert y3.shape == (2, 3, 40)
    assert torch.equal(y3.reshape(6, 40), quant_matmul(x3.reshape(6, 96), weight))
    assert quant_matmul(torch.empty(0, 96), weight).shape == (0, 40)


@needs_kernels
@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_dequantize_is_bitwise_gguf(type_name: str) -> None:
    block = block_size(type_name)
    weight, w = random_weight(type_name, 19, 5 * block, seed=3)
    out = dequantize(weight)
    assert out.dtype == torch.float32 and out.shape == (19, 5 * block)
    assert np.array_equal(out.numpy().view(np.uint32), w.view(np.uint32))
    assert np.array_equal(dequantize(weight, slice(4, 11)).numpy().view(np.uint32), w[4:11].view(np.uint32))
    assert dequantize(weight, slice(7, 7)).shape == (0, 5 * block)
    with pytest.raises(ValueError, match="step 1"):
        dequantize(weight, slice(0, 10, 2))


def test_unsupported_types_raise() -> None:
    for name in ("Q5_0", "Q2_K", "IQ4_XS", "F16"):
        with pytest.raises(ValueError, match=name):
            check_supported(name)
        with pytest.raises(ValueError, match=name):
            QuantizedWeight(name, (1, 32), torch.zeros(1, 22, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantizedWeight("Q4_K", (1, 32), torch.zeros(1, 18, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous blocks"):
        QuantizedWeight("Q4_0", (2, 64), torch.zeros(2, 35, dtype=torch.uint8))


@needs_kernels
def test_kernel_rejects_bad_arguments() -> None:
    lib = load_library()
    w = torch.zeros(4, 34, dtype=torch.uint8)
    x, y = torch.zeros(1, 32), torch.zeros(1, 4)
    for fn in (lib.quant_matmul_f32, lib.quant_matmul_f32_portable):
        assert fn(6, w.data_ptr(), 4, 32, x.data_ptr(), 1, 32, y.data_ptr(), 4) == -1  # Q5_0
        assert fn(8, w.data_ptr(), 4, 48, x.data_ptr(), 1, 48, y.data_ptr(), 4) == -2  # 48 values
        assert fn(8, w.data_ptr(), 4, 32, x.data_ptr(), 1, 32, y.data_ptr(), 4) == 0
    assert lib.quant_dequantize_f32(6, w.data_ptr(), 0, 1, 32, y.data_ptr()) == -1
    assert lib.quant_dequantize_f32(12, w.data_ptr(), 0, 1, 32, y.data_ptr()) == -2


@functools.cache
def _default_model_tensors() -> dict[str, QuantizedWeight]:
    reader = GGUFReader(default_model_path())
    wanted = {"blk.0.ffn_down.weight", "token_embd.weight"}
    return {t.name: QuantizedWeight.from_gguf(t) for t in reader.tensors if t.name in wanted}


@needs_kernels
@pytest.mark.parametrize("name", ["blk.0.ffn_down.weight", "token_embd.weight"])
def test_default_model_weights(name: str) -> None:
    """A Q4_1 layer of the default model and its Q8_0 embedding (the tied LM head)."""
    weight = _default_model_tensors()[name]
    assert weight.type_name == {"token_embd.weight": "Q8_0"}.get(name, "Q4_1")
    dense = dequantize(weight)
    reference = gguf_dequantize(weight.blocks.numpy(), GGMLQuantizationType[weight.type_name])
    assert np.array_equal(dense.numpy().view(np.uint32), reference.view(np.uint32))
    x = random_input(3, weight.in_features, 32, seed=11)
    assert_product_close(quant_matmul(x, weight), x, reference, weight.type_name)


# The other instruction sets this machine can run, built from the same file on their own.
VARIANTS = {
    "portable": ([], 0, ()),
    "avx2": (["-mavx2", "-mfma", "-mf16c"], 1, ("avx2", "fma", "f16c")),
    "avx2-vnni": (["-mavx2", "-mfma", "-mf16c", "-mavxvnni"], 2, ("avx2", "fma", "f16c", "avx_vnni")),
}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.fixture(scope="module")
def variant_libraries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ctypes.CDLL | str]:
    """Each variant compiled (in parallel) to its own library, or why not."""
    try:
        cc = library._compiler()
    except library.KernelBuildError as exc:
        return dict.fromkeys(VARIANTS, str(exc))
    tmp = tmp_path_factory.mktemp("quant_variants")
    flags = _cpu_flags()
    builds: dict[str, subprocess.Popen[bytes] | str] = {}
    for name, (extra, _, needed) in VARIANTS.items():
        missing = [f for f in needed if f not in flags]
        if missing:
            builds[name] = f"the CPU lacks {', '.join(missing)}"
            continue
        obj, lib_path = tmp / f"{name}.o", tmp / f"{name}.so"
        # Compiled with -ffast-math as the engine's own library is, but linked without it: a link with
        # it adds crtfastmath.o, which turns subnormals off in the whole test process.
        compile_cmd = [cc, "-O3", *extra, "-fopenmp", "-ffast-math", "-fPIC", "-std=c11", "-c", str(SOURCE)]
        link_cmd = [cc, "-shared", "-fopenmp", str(obj), "-o", str(lib_path), "-lm"]
        script = f"{shlex.join([*compile_cmd, '-o', str(obj)])} && {shlex.join(link_cmd)}"
        builds[name] = subprocess.Popen(["sh", "-c", script], stderr=subprocess.PIPE)
    libs: dict[str, ctypes.CDLL | str] = {}
    for name, build in builds.items():
        if isinstance(build, str):
            libs[name] = build
            continue
        _, err = build.communicate()
        if build.returncode:
            libs[name] = f"compiler failed: {err.decode()[-500:]}"
            continue
        lib = ctypes.CDLL(str(tmp / f"{name}.so"))
        for fn, argtypes in library._SIGNATURES.items():
            if fn.startswith("quant_"):
                getattr(lib, fn).argtypes = argtypes
                getattr(lib, fn).restype = library._RETURNS.get(fn)
        libs[name] = lib
    return libs


@needs_kernels
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_other_instruction_sets(variant: str, variant_libraries: dict[str, ctypes.CDLL | str]) -> None:
    """The AVX2 (with and without AVX-VNNI) and portable builds (portable fp16 conversion included),
    whatever the machine's own build takes."""
    lib = variant_libraries[variant]
    if isinstance(lib, str):
        pytest.skip(lib)
    assert lib.quant_kernel_isa() == VARIANTS[variant][1]
    for type_name in SUPPORTED_TYPES:
        block = block_size(type_name)
        for rows, (n, k) in [(1, (5, block)), (7, (33, 3 * block)), (33, (9, 5 * block))]:
            weight, w = random_weight(type_name, n, k, seed=rows)
            x = random_input(rows, k, block, seed=rows + 1)
            y = torch.empty(rows, n)
            rc = lib.quant_matmul_f32(
                weight.type_id, weight.blocks.data_ptr(), n, k, x.data_ptr(), rows, k, y.data_ptr(), n
            )
            assert rc == 0
            assert_product_close(y, x, w, type_name)
            alone = torch.empty(1, n)
            lib.quant_matmul_f32(weight.type_id, weight.blocks.data_ptr(), n, k, x[-1:].data_ptr(), 1, k,
                                 alone.data_ptr(), n)  # fmt: skip
            assert torch.equal(alone, y[-1:])
            dense = torch.empty(n, k)
            assert (
                lib.quant_dequantize_f32(weight.type_id, weight.blocks.data_ptr(), 0, n, k, dense.data_ptr())
                == 0
            )
            assert np.array_equal(dense.numpy().view(np.uint32), w.view(np.uint32))


@needs_kernels
def test_kernel_isa_is_named() -> None:
    isa = kernel_isa()
    assert isa.removesuffix(" + AMX-BF16") in {"portable C", "AVX2", "AVX2 + AVX-VNNI", "AVX-512 VNNI"}
    assert isa.endswith(" + AMX-BF16") == amx_enabled()
