"""Which projections of a decoder layer an adapter may target, and where each lives in the model.

The model fuses q/k/v into ``self_attn.qkv_proj`` and gate/up into ``mlp.gate_up_proj``: an adapter's
``q_proj`` is sub-projection 0 of the fused layer, ``k_proj`` 1, and so on. A LoRA layer keeps one
A and one B per sub-projection (see :class:`pagedllm.lora.layers.LoRALinear`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.model.config import ModelConfig


@dataclass(frozen=True)
class Target:
    module: str  # the model's module under a decoder layer, e.g. "self_attn.qkv_proj"
    sub: int  # the sub-projection's index in the fused module
    in_features: int
    out_features: int


# Projections in the order of the fused modules' outputs.
TARGET_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Names an adapter may use for the fused forms themselves (Phi-3 style checkpoints).
FUSED_NAMES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def model_targets(cfg: ModelConfig) -> dict[str, Target]:
    """Each targetable projection of ``cfg``'s decoder layers."""
    h, q, kv, ffn = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {
        "q_proj": Target("self_attn.qkv_proj", 0, h, q),
        "k_proj": Target("self_attn.qkv_proj", 1, h, kv),
        "v_proj": Target("self_attn.qkv_proj", 2, h, kv),
        "o_proj": Target("self_attn.o_proj", 0, q, h),
        "gate_proj": Target("mlp.gate_up_proj", 0, h, ffn),
        "up_proj": Target("mlp.gate_up_proj", 1, h, ffn),
        "down_proj": Target("mlp.down_proj", 0, ffn, h),
    }


def fused_layout(cfg: ModelConfig) -> dict[str, list[int]]:
    """Each LoRA-capable module of a decoder layer -> the output sizes of its sub-projections."""
    layout: dict[str, list[int]] = {}
    for target in model_targets(cfg).values():
        layout.setdefault(target.module, []).append(target.out_features)
    return layout
