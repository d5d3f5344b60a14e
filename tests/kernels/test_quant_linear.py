"""The layers over GGUF blocks (:mod:`pagedllm.kernels.cpu.quant_linear`): a projection of several
parts equals its parts' products side by side, bit for bit, at every row count; adjacent parts of one
type are merged without changing a bit; a bias is added once; embedding rows are the dequantizer's."""

from __future__ import annotations

import pytest
import torch

from helpers.quant_weights import random_weight
from pagedllm.kernels.cpu.library import kernels_available
from pagedllm.kernels.cpu.quant import QuantizedWeight, amx_enabled, dequantize, gather_rows, quant_matmul
from pagedllm.kernels.cpu.quant_linear import QuantEmbedding, QuantLinear
from pagedllm.kernels.cpu.row_paths import current_split, prompt_rows

needs_kernels = pytest.mark.skipif(not kernels_available(), reason="no C compiler for the CPU kernels")


def _parts() -> list[QuantizedWeight]:
    # A q/k/v-like stack: 64 rows of Q4_K; 32 of Q6_K and the 32 that follow them in memory (merged,
    # as tensors next to each other in a mapped file); 16 more of Q6_K elsewhere (kept apart).
    q6 = random_weight("Q6_K", 64, 256, seed=2)[0].blocks
    return [
        random_weight("Q4_K", 64, 256, seed=1)[0],
        QuantizedWeight("Q6_K", (32, 256), q6[:32]),
        QuantizedWeight("Q6_K", (32, 256), q6[32:]),
        random_weight("Q6_K", 16, 256, seed=3)[0],
    ]


@needs_kernels
@pytest.mark.parametrize("rows", [1, 5, 17, 300])
def test_parts_side_by_side_bitwise(rows: int) -> None:
    parts = _parts()
    layer = QuantLinear(parts, bias=True)
    assert [p.type_name for p in layer.parts] == ["Q4_K", "Q6_K", "Q6_K"]  # two Q6_K parts merged
    assert layer.parts[1].blocks.data_ptr() == parts[1].blocks.data_ptr()  # a view: nothing copied
    assert (layer.in_features, layer.out_features) == (256, 144)
    assert layer.nbytes == sum(p.nbytes for p in parts)
    with torch.no_grad():
        layer.bias.copy_(torch.linspace(-1, 1, 144))  # type: ignore[union-attr]
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    expected = torch.cat([quant_matmul(x, p) for p in parts], dim=1) + torch.linspace(-1, 1, 144)
    assert torch.equal(layer(x), expected)
    # 3-D input, and a row's output independent of the other rows.
    assert torch.equal(layer(x.view(1, rows, 256))[0], expected)
    assert torch.equal(layer(x[-1:]), expected[-1:])


@needs_kernels
def test_marked_prompt_rows_take_the_tiles_and_the_others_the_integer_kernels() -> None:
    """Inside :func:`prompt_rows`, each row takes the path of its mark, bitwise as a product of that
    row alone on that path, whatever the other rows are (runs of both kinds, interleaved)."""
    layer = QuantLinear(_parts(), bias=True)
    with torch.no_grad():
        layer.bias.copy_(torch.linspace(-1, 1, 144))  # type: ignore[union-attr]
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(6))
    integer = layer(x)  # no mark: every row on the integer kernels
    tiles = amx_enabled()
    if tiles:
        with prompt_rows([True] * 40):
            on_tiles = layer(x)
        assert not torch.equal(on_tiles, integer)
    else:
        on_tiles = integer  # no AMX here (or PAGEDLLM_CPU_AMX=0): every mark means the integer kernels
    for mask in (
        [True] * 20 + [False] * 20,
        [False] * 3 + [True] * 30 + [False] * 7,
        [i % 3 == 0 for i in range(40)],
    ):
        with prompt_rows(mask):
            got = layer(x)
        for i, is_prompt in enumerate(mask):
            assert torch.equal(got[i], on_tiles[i] if is_prompt else integer[i]), (mask, i)
        with prompt_rows(mask), pytest.raises(RuntimeError, match="39 rows inside a prompt-row mark for 40"):
            layer(x[1:])
    assert current_split() is None  # the mark ends with its block


@needs_kernels
def test_quant_matmul_writes_into_a_column_range() -> None:
    weight, _ = random_weight("Q8_0", 48, 64, seed=4)
    x = torch.randn(7, 64)
    wide = torch.full((7, 100), 7.0)
    quant_matmul(x, weight, out=wide[:, 10:58])
    assert torch.equal(wide[:, 10:58], quant_matmul(x, weight))
    assert bool((wide[:, :10] == 7.0).all()) and bool((wide[:, 58:] == 7.0).all())
    with pytest.raises(ValueError, match="out must be"):
        quant_matmul(x, weight, out=torch.empty(7, 47))


def test_parts_must_share_the_input_size() -> None:
    with pytest.raises(ValueError, match="different input sizes"):
        QuantLinear([random_weight("Q8_0", 32, 64, seed=0)[0], random_weight("Q8_0", 32, 96, seed=0)[0]])
    with pytest.raises(ValueError, match="at least one"):
        QuantLinear([])


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q6_K"])
def test_embedding_rows_are_the_dequantizers(type_name: str) -> None:
    weight, _ = random_weight(type_name, 40, 256, seed=5)
    table = dequantize(weight)
    embed = QuantEmbedding(weight)
    ids = torch.tensor([[3, 0, 39], [3, 3, 17]])
    got = embed(ids)
    assert got.shape == (2, 3, 256)
    assert torch.equal(got, table[ids])
    assert torch.equal(gather_rows(weight, torch.tensor([], dtype=torch.int64)), table[:0])
    for bad in (40, -1):
        with pytest.raises(IndexError, match="row ids"):
            embed(torch.tensor([1, bad]))
