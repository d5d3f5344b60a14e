"""The AMX path of the GGUF-quantized products (``pagedllm/kernels/csrc/quant_amx_cpu.c``): x and the
dequantized weight rounded to bfloat16, products summed in float32.

Tolerance. Against the float64 product of x and gguf's dequantized weight, both rounded to bfloat16 as
the kernel rounds them (to nearest even), the differences allowed are float32 summation (1e-5 of the
sum of the magnitudes; a hundred times what 1,024 float32 additions can reach) and a weight that the
kernel's fused ``d * q + m`` rounds to the neighbouring bfloat16 (a few terms at 2^-8 each). Any slip
in a block's layout, a panel's interleaving or a tile's placement is far larger.
"""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.quant_weights import random_weight
from pagedllm.kernels.cpu import library
from pagedllm.kernels.cpu.library import kernels_available, load_library
from pagedllm.kernels.cpu.quant import SUPPORTED_TYPES, amx_available, amx_enabled, block_size, quant_matmul

needs_amx = pytest.mark.skipif(
    not kernels_available() or not amx_available(), reason="no AMX-BF16 (or no C compiler) here"
)


SOURCE = Path(library.__file__).parent.parent / "csrc" / "quant_amx_cpu.c"


def bf16(a: torch.Tensor) -> torch.Tensor:
    return a.to(torch.bfloat16).to(torch.float64)


def assert_bf16_close(y: torch.Tensor, x: torch.Tensor, w: np.ndarray) -> None:
    xb, wb = bf16(x), bf16(torch.from_numpy(w))
    magnitude = xb.abs() @ wb.abs().T
    largest = (xb.abs()[:, None, :] * wb.abs()[None, :, :]).amax(dim=-1)
    tol = 1e-5 * magnitude + 2**-6 * largest + 1e-30
    err = (y.double() - xb @ wb.T).abs()
    worst = int(torch.argmax(err / tol))
    assert (err <= tol).all(), f"error {err.flatten()[worst]:.3e} > {tol.flatten()[worst]:.3e} at {worst}"


# (out_features, in_features / block, rows): one block, odd block counts, n and rows below, at and
# past multiples of 16 and 32, k not a multiple of 256 (32-value types: 32 values per dequantized
# step), and a wide n whose columns each thread takes in more than one panel.
SHAPES = [(5, 1, 1), (16, 3, 16), (37, 3, 17), (70, 9, 33), (33, 5, 48), (600, 1, 20)]


@needs_amx
@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_matches_bfloat16_reference(type_name: str) -> None:
    block = block_size(type_name)
    for i, (n, blocks, rows) in enumerate(SHAPES):
        weight, w = random_weight(type_name, n, blocks * block, seed=40 + i)
        x = torch.randn(rows, blocks * block, generator=torch.Generator().manual_seed(i))
        y = quant_matmul(x, weight, amx=True)
        assert y.shape == (rows, n) and y.dtype == torch.float32
        assert_bf16_close(y, x, w)


@needs_amx
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "Q4_1"])
def test_rows_are_independent(type_name: str) -> None:
    """On the AMX path too, a row's result is bitwise the same in any batch (any row count, any place
    in it: first or second tile block of a pair, a partial block) and with any number of threads: the
    padding rows of a partial tile of 16 are zeros and touch no other row, and each output sums over k
    in an order fixed by k alone. The engine relies on this to run a prompt token on the tiles in
    whatever step it falls (:mod:`pagedllm.kernels.cpu.row_paths`)."""
    block = block_size(type_name)
    weight, _ = random_weight(type_name, 45, 2 * block, seed=7)
    x = torch.randn(100, 2 * block, generator=torch.Generator().manual_seed(8))
    full = quant_matmul(x, weight, amx=True)
    for r0, r1 in [
        (0, 1),
        (5, 6),
        (0, 24),
        (5, 77),
        (99, 100),
        (3, 100),
        (16, 17),
        (15, 47),
        (31, 64),
        (40, 73),
    ]:
        assert torch.equal(quant_matmul(x[r0:r1], weight, amx=True), full[r0:r1]), (r0, r1)
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            assert torch.equal(quant_matmul(x, weight, amx=True), full), count
    finally:
        torch.set_num_threads(threads)


@needs_amx
@pytest.mark.parametrize("type_name", ["Q4_K", "Q4_0"])
def test_the_caller_picks_the_path(type_name: str) -> None:
    """quant_matmul takes the tiles only when asked (``amx=True``), whatever the row count: the path
    is the caller's choice per row, never the product's size."""
    block = block_size(type_name)
    weight, _ = random_weight(type_name, 24, 2 * block, seed=9)
    x = torch.randn(64, 2 * block, generator=torch.Generator().manual_seed(10))
    for rows in (1, 16, 64):
        assert torch.equal(quant_matmul(x[:rows], weight), quant_matmul(x[:rows], weight, amx=False)), rows
    assert not torch.equal(quant_matmul(x, weight, amx=True), quant_matmul(x, weight, amx=False))


def test_amx_is_on_by_default_and_the_variable_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDLLM_CPU_AMX", raising=False)
    assert amx_enabled() == amx_available()
    monkeypatch.setenv("PAGEDLLM_CPU_AMX", "1")
    assert amx_enabled() == amx_available()
    monkeypatch.setenv("PAGEDLLM_CPU_AMX", "0")
    assert not amx_enabled()
    monkeypatch.setenv("PAGEDLLM_CPU_AMX", "yes")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_AMX must be 0"):
        amx_enabled()


@needs_amx
def test_strided_input_and_output_column_range() -> None:
    weight, w = random_weight("Q4_K", 48, 512, seed=11)
    wide = torch.randn(40, 700, generator=torch.Generator().manual_seed(12))
    x = wide[:, 100:612]  # row stride 700
    out = torch.full((40, 80), 7.0)
    quant_matmul(x, weight, out=out[:, 20:68], amx=True)
    assert torch.equal(out[:, 20:68], quant_matmul(x.contiguous(), weight, amx=True))
    assert (out[:, :20] == 7.0).all() and (out[:, 68:] == 7.0).all()
    assert_bf16_close(out[:, 20:68], x, w)
    assert quant_matmul(torch.empty(0, 512), weight, amx=True).shape == (0, 48)


@needs_amx
def test_kernel_rejects_bad_arguments() -> None:
    lib = load_library()
    w = torch.zeros(4, 34, dtype=torch.uint8)
    x, y = torch.zeros(1, 32), torch.zeros(1, 4)
    fn = lib.amx_quant_matmul_f32
    assert fn(6, w.data_ptr(), 4, 32, x.data_ptr(), 1, 32, y.data_ptr(), 4) == -1  # Q5_0
    assert fn(8, w.data_ptr(), 4, 48, x.data_ptr(), 1, 48, y.data_ptr(), 4) == -2  # 48 values
    assert fn(8, w.data_ptr(), 4, 32, x.data_ptr(), 1, 32, y.data_ptr(), 4) == 0


@pytest.mark.skipif(not kernels_available(), reason="no C compiler for the CPU kernels")
def test_without_amx_nothing_runs_on_tiles(tmp_path: Path) -> None:
    """Compiled for a CPU without AMX, the file reports it and the product says so (code -4, nothing
    written); asking for the tiles through the portable path is an error."""
    target = tmp_path / "noamx.so"
    flags = ["-O2", "-fopenmp", "-fPIC", "-std=c11", "-shared"]
    cmd = [library._compiler(), *flags, str(SOURCE), "-o", str(target)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(target))
    for name in ("amx_quant_available", "amx_quant_matmul_f32"):
        getattr(lib, name).argtypes = library._SIGNATURES[name]
        getattr(lib, name).restype = library._RETURNS[name]
    assert lib.amx_quant_available() == 0
    w, x, y = torch.zeros(4, 34, dtype=torch.uint8), torch.zeros(1, 32), torch.full((1, 4), 3.0)
    assert lib.amx_quant_matmul_f32(8, w.data_ptr(), 4, 32, x.data_ptr(), 1, 32, y.data_ptr(), 4) == -4
    assert (y == 3.0).all()
    weight, _ = random_weight("Q8_0", 4, 32, seed=1)
    with pytest.raises(RuntimeError, match="amx=True"):
        quant_matmul(x, weight, portable=True, amx=True)
