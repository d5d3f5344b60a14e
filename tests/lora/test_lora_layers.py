"""The LoRA layer, its row mapping and its slots, on random data: the two kernels (BLAS per slot, and
the segmented Triton kernels under the interpreter) against a float64 reference row by row; the slots'
invariants through loads and evictions."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from torch import nn

from pagedllm.lora.adapter import LoRAAdapter, SubLoRA
from pagedllm.lora.layers import LoRALinear
from pagedllm.lora.mapping import LoRAMapping, lora_rows
from pagedllm.lora.slots import LoRASlots
from pagedllm.lora_request import LoRARequest

IN, SUBS = 24, [40, 16, 16]  # a fused q/k/v-like projection


def _subs(rank: int, targeted: list[bool], gen: torch.Generator) -> list[SubLoRA | None]:
    return [
        SubLoRA(torch.randn(rank, IN, generator=gen), torch.randn(out, rank, generator=gen)) if on else None
        for out, on in zip(SUBS, targeted, strict=True)
    ]


def test_mapping_groups_and_segments() -> None:
    m = LoRAMapping.from_row_slots([1, 1, -1, 0, 0, 0, 1, -1])
    assert m is not None
    groups = {slot: rows for slot, rows in m.groups}
    assert groups[0] == slice(3, 6)
    assert torch.equal(groups[1], torch.tensor([0, 1, 6]))  # type: ignore[arg-type]
    assert (m.seg_starts, m.seg_lens, m.seg_slots) == ((0, 3, 6), (2, 3, 1), (1, 0, 1))
    assert m.max_seg_len == 3
    assert LoRAMapping.from_row_slots([-1, -1]) is None


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize(
    "row_slots",
    [
        [0, 0, -1, 2, 2, 2, 0, -1, 2],  # two slots, uneven (a padded batch)
        [0, 2, 0, 2],  # two slots, even
        [2, 2, 2, -1],  # one slot, one run
        [0, -1, 0],  # one slot, two runs
        [1, 1, -1],  # an emptied slot: nothing added
    ],
)
def test_layer_adds_each_rows_adapter(kernel: str, row_slots: list[int]) -> None:
    gen = torch.Generator().manual_seed(1)
    base = nn.Linear(IN, sum(SUBS), bias=False)
    layer = LoRALinear(base, IN, SUBS, 3, 8, torch.float32, torch.device("cpu"), kernel=kernel)
    adapters = {0: (8, _subs(8, [True, False, True], gen)), 2: (3, _subs(3, [True, True, True], gen))}
    for slot, (rank, subs) in adapters.items():
        layer.set_slot(slot, rank, subs)
    layer.set_slot(1, 4, _subs(4, [True, True, True], gen))
    layer.clear_slot(1)  # emptied: its rows (none here) and its weights read as zero
    x = torch.randn(len(row_slots), IN, generator=gen)
    with lora_rows(LoRAMapping.from_row_slots(row_slots)):
        y = layer(x)
    expected = base(x).double()
    for row, slot in enumerate(row_slots):
        if slot not in adapters:
            continue
        rank, subs = adapters[int(slot)]
        offset = 0
        for out, sub in zip(SUBS, subs, strict=True):
            if sub is not None:
                expected[row, offset : offset + out] += sub.b.double() @ (sub.a.double() @ x[row].double())
            offset += out
    torch.testing.assert_close(y.double(), expected, rtol=1e-4, atol=1e-4)
    assert float(layer.a_slots[1].abs().sum()) == 0 and float(layer.b_slots[1].abs().sum()) == 0  # emptied
    with lora_rows(None):
        torch.testing.assert_close(layer(x), base(x))


def _adapter(lid: int) -> LoRAAdapter:
    gen = torch.Generator().manual_seed(lid)
    adapter = LoRAAdapter(LoRARequest(f"a{lid}", lid, "/adapters"), 2, 1.0)
    adapter.modules[(0, "m")] = _subs(2, [True, True, True], gen)
    return adapter


def test_slots_keep_their_invariants() -> None:
    layer = LoRALinear(
        nn.Linear(IN, sum(SUBS)), IN, SUBS, 2, 2, torch.float32, torch.device("cpu"), kernel="torch"
    )
    slots = LoRASlots({(0, "m"): layer}, max_loras=2)

    def check() -> None:
        assert len(set(slots.slot_of.values())) == len(slots.slot_of)
        for lid, slot in slots.slot_of.items():
            assert slots.adapter_in[slot] == lid
            sub = _adapter(lid).modules[(0, "m")][0]
            assert sub is not None and torch.equal(layer.a_slots[slot, :, :2].t(), sub.a)

    first = slots.activate([_adapter(1), _adapter(2)])
    check()
    assert sorted(first.values()) == [0, 1]
    again = slots.activate([_adapter(2)])  # 2 most recent now
    assert again == {2: first[2]} and slots.loads == 2
    third = slots.activate([_adapter(3)])  # evicts 1, the least recently used
    check()
    assert third == {3: first[1]} and 1 not in slots.slot_of
    with pytest.raises(ValueError, match="slots"):
        slots.activate([_adapter(4), _adapter(5), _adapter(6)])
    slots.remove(3)
    check()
    assert slots.adapter_in.count(None) == 1
