"""The adapter slots of a model: which adapter's weights sit in which slot of every LoRA layer.

Invariants: an adapter id is in at most one slot (``slot_of``), a slot holds at most one adapter, and
the weights in slot ``s`` of every :class:`LoRALinear` are those of ``adapter_in[s]``. A step asks for
its adapters with :meth:`activate`; those not yet in a slot take a free slot or the least recently
used slot whose adapter the step does not need. The scheduler never puts more distinct adapters in a
step than there are slots, so :meth:`activate` always finds room.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from pagedllm.lora.adapter import LoRAAdapter
from pagedllm.lora.layers import LoRALinear
from pagedllm.lora.targets import fused_layout
from pagedllm.model.config import ModelConfig


def add_lora_layers(
    model: nn.Module,
    cfg: ModelConfig,
    max_loras: int,
    max_rank: int,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[tuple[int, str], LoRALinear]:
    """Wrap every targetable projection of ``model``'s decoder layers in a :class:`LoRALinear`."""
    layers: dict[tuple[int, str], LoRALinear] = {}
    layout = fused_layout(cfg)
    in_features = {"self_attn.qkv_proj": cfg.hidden_size, "self_attn.o_proj": cfg.q_size,
                   "mlp.gate_up_proj": cfg.hidden_size, "mlp.down_proj": cfg.intermediate_size}  # fmt: skip
    for index, layer in enumerate(model.layers):  # type: ignore[union-attr,arg-type]
        for path, sizes in layout.items():
            parent_name, attr = path.split(".")
            parent = getattr(layer, parent_name)
            base = getattr(parent, attr)
            wrapped = LoRALinear(base, in_features[path], sizes, max_loras, max_rank, dtype, device)
            setattr(parent, attr, wrapped)
            layers[(index, path)] = wrapped
    return layers


class LoRASlots:
    """``max_loras`` slots of adapter weights in the model's LoRA layers (see the module's invariants)."""

    def __init__(self, layers: dict[tuple[int, str], LoRALinear], max_loras: int) -> None:
        self.layers = layers
        self.max_loras = max_loras
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recent first
        self.adapter_in: list[int | None] = [None] * max_loras
        self.loads = 0  # adapters written into a slot, total

    def activate(self, adapters: list[LoRAAdapter]) -> dict[int, int]:
        """Put each of ``adapters`` (distinct ids) in a slot; returns id -> slot."""
        wanted = {a.request.lora_int_id for a in adapters}
        if len(wanted) > self.max_loras:
            raise ValueError(f"a step with {len(wanted)} adapters; there are {self.max_loras} slots.")
        for adapter in adapters:
            lid = adapter.request.lora_int_id
            if lid in self.slot_of:
                self.slot_of.move_to_end(lid)
                continue
            slot = self._free_slot(wanted)
            for (layer, module), lora_layer in self.layers.items():
                lora_layer.set_slot(slot, adapter.rank, adapter.modules.get((layer, module)))
            self.adapter_in[slot] = lid
            self.slot_of[lid] = slot
            self.loads += 1
        return {lid: self.slot_of[lid] for lid in wanted}

    def _free_slot(self, wanted: set[int]) -> int:
        for slot, held in enumerate(self.adapter_in):
            if held is None:
                return slot
        for lid, slot in self.slot_of.items():  # least recently used first
            if lid not in wanted:
                self.remove(lid)
                return slot
        raise AssertionError("no slot free for the step's adapters")

    def remove(self, lora_int_id: int) -> None:
        """Empty the slot of adapter ``lora_int_id`` (nothing if it holds none)."""
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is None:
            return
        self.adapter_in[slot] = None
        for lora_layer in self.layers.values():
            lora_layer.clear_slot(slot)
