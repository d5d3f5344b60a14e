"""LoRA adapters: many fine-tunes of one base model served together (vLLM's names)."""

from pagedllm.lora_request import LoRARequest

__all__ = ["LoRARequest"]
