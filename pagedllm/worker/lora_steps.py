"""The worker's side of LoRA: the model's adapter slots, and which rows of a step run which slot.

Each step, :meth:`LoRAWorker.mapping` puts the adapters of the step's requests in slots (reading
them through the engine's :class:`~pagedllm.lora.registry.LoRARegistry`, which checked them when their
requests were added) and returns the :class:`~pagedllm.lora.mapping.LoRAMapping` that the model's
LoRA layers read during the forward.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pagedllm.lora.adapter import LoRAAdapter
from pagedllm.lora.mapping import LoRAMapping
from pagedllm.lora.registry import LoRAConfig, LoRARegistry
from pagedllm.lora.slots import LoRASlots, add_lora_layers
from pagedllm.model.config import ModelConfig
from pagedllm.model.moe import is_moe_model
from pagedllm.sched.scheduler import SchedulerOutput


class LoRAWorker:
    """Adapter slots in ``model`` (its projections wrapped on construction) and the registry."""

    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        config: LoRAConfig,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        if is_moe_model(model):
            raise ValueError("enable_lora: LoRA adapters on mixture-of-experts layers are not supported.")
        layers = add_lora_layers(model, model_config, config.max_loras, config.max_lora_rank, device, dtype)
        self.slots = LoRASlots(layers, config.max_loras)
        self.registry = LoRARegistry(config, model_config)
        self.slot_bytes = sum(
            t.numel() * t.element_size() for m in layers.values() for t in (m.a_slots, m.b_slots)
        )

    def mapping(self, scheduler_output: SchedulerOutput, query_start_loc: np.ndarray) -> LoRAMapping | None:
        """Put the step's adapters in slots; the rows of each (None: every row runs the base model)."""
        rows = scheduler_output.scheduled_requests
        adapters: dict[int, LoRAAdapter] = {}
        for s in rows:
            lora = s.request.lora_request
            if lora is not None and lora.lora_int_id not in adapters:
                adapters[lora.lora_int_id] = self.registry.get(lora)
        if not adapters:
            return None
        slot_of = self.slots.activate(list(adapters.values()))
        row_slots = np.full(int(query_start_loc[len(rows)]), -1, dtype=np.int64)
        for i, s in enumerate(rows):
            lid = s.request.lora_int_id
            if lid:
                row_slots[query_start_loc[i] : query_start_loc[i + 1]] = slot_of[lid]
        return LoRAMapping.from_row_slots(row_slots)

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (unloaded); whether it was known."""
        self.slots.remove(lora_int_id)
        return self.registry.remove(lora_int_id)
