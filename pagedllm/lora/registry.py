"""The engine's adapters in host memory: read once, checked against the model, kept for reuse.

``get`` reads an adapter the first time its id is met (a RequestError naming ``lora_path`` if it
cannot be served) and keeps up to ``max_cpu_loras`` of them, least recently used dropped first (a
dropped adapter is read again when a request names it). An id stays bound to the name and path it was
first given until :meth:`remove`: a request giving another adapter the same id is refused.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagedllm.errors import RequestError
from pagedllm.lora.adapter import LoRAAdapter, load_adapter
from pagedllm.lora_request import LoRARequest
from pagedllm.model.config import ModelConfig


@dataclass(frozen=True)
class LoRAConfig:
    """The engine's LoRA settings (checked by :class:`pagedllm.config.EngineConfig`)."""

    max_loras: int = 1  # adapters in one step (slots of adapter weights)
    max_lora_rank: int = 16  # largest rank accepted (slots are sized for it)
    max_cpu_loras: int | None = None  # adapters kept in host memory (None: max_loras)

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


class LoRARegistry:
    """Adapters read for one model (see the module's docstring)."""

    def __init__(self, config: LoRAConfig, model_config: ModelConfig) -> None:
        self.config = config
        self.model_config = model_config
        self._cache: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._bound: dict[int, LoRARequest] = {}
        self.reads = 0  # adapter files read, total

    def get(self, request: LoRARequest) -> LoRAAdapter:
        lid = request.lora_int_id
        bound = self._bound.get(lid)
        if bound is not None and (bound.lora_name, bound.lora_path) != (request.lora_name, request.lora_path):
            raise RequestError(
                "lora_request",
                f"lora_int_id {lid} is already the adapter {bound.lora_name!r} ({bound.lora_path}); "
                f"give {request.lora_name!r} another id.",
            )
        adapter = self._cache.get(lid)
        if adapter is None:
            adapter = load_adapter(request, self.model_config, self.config.max_lora_rank)
            self.reads += 1
            self._cache[lid] = adapter
            self._bound[lid] = request
            while len(self._cache) > self.config.cpu_capacity:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(lid)
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (its id may then name another); whether it was known."""
        self._cache.pop(lora_int_id, None)
        return self._bound.pop(lora_int_id, None) is not None

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._bound
