"""A request's adapter: vLLM's ``LoRARequest`` (name, integer id, path), validated on construction;
shared by every room (also importable from ``pagedllm`` and ``pagedllm.lora``).

The integer id is the adapter's identity inside the engine: its slot, the prefix cache's key and the
scheduler's count of adapters in a step go by it. Two requests with one id must name one adapter.
"""

from __future__ import annotations

import msgspec

from pagedllm.errors import RequestError


class LoRARequest(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """The adapter a request runs with (``lora_int_id`` > 0; 0 would be the base model)."""

    lora_name: str  # the name users give it (the server's ``model`` field)
    lora_int_id: int  # unique per adapter among those an engine serves, >= 1
    lora_path: str = ""  # a PEFT folder or a llama.cpp GGUF adapter file
    base_model_name: str | None = None  # the model it was trained on (listed as its parent)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name.strip():
            raise RequestError(
                "lora_request", f"lora_request.lora_name must be a non-empty name, got {self.lora_name!r}."
            )
        if (
            isinstance(self.lora_int_id, bool)
            or not isinstance(self.lora_int_id, int)
            or self.lora_int_id < 1
        ):
            raise RequestError(
                "lora_request", f"lora_request.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}."
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise RequestError(
                "lora_request",
                f"lora_request.lora_path must name the adapter's folder or file, got {self.lora_path!r}.",
            )
