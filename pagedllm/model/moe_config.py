"""The sparse mixture-of-experts part of a model's configuration (Mixtral, Qwen2-MoE, Qwen3-MoE):
which layers are sparse, the router's top-k, the experts' shape and how checkpoints name them.

Read by :class:`pagedllm.model.config.ModelConfig` (its ``moe`` field) and run by
:mod:`pagedllm.model.moe`. No torch here: checkpoint tensors are only sliced and renamed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class MoeConfig:
    """The sparse mixture-of-experts MLP of Mixtral, Qwen2-MoE and Qwen3-MoE.

    Layer ``i`` is sparse unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``
    is not 0 (then it has the dense MLP of ``ModelConfig.intermediate_size``). A sparse layer routes
    each token to its ``top_k`` most probable experts (softmax over ``num_experts`` router logits),
    weighted by those probabilities, renormalised to sum to 1 when ``norm_topk_prob``. Each expert is
    a SwiGLU MLP of width ``intermediate_size``; ``shared_expert_intermediate_size`` > 0 adds
    Qwen2-MoE's shared expert (run for every token, scaled by a sigmoid gate).
    ``checkpoint_names`` is how a checkpoint names the experts: "mixtral"
    (``block_sparse_moe.experts.{e}.w1/w3/w2``) or "qwen" (``mlp.experts.{e}.gate_proj/up_proj/down_proj``).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    checkpoint_names: str
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MoeConfig.{name} must be a positive integer, got {value!r}.")
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) exceeds num_experts ({self.num_experts}).")
        if self.checkpoint_names not in ("mixtral", "qwen"):
            raise ValueError(
                f"MoeConfig.checkpoint_names must be 'mixtral' or 'qwen', got {self.checkpoint_names!r}."
            )
        self.mlp_only_layers = [int(i) for i in self.mlp_only_layers]

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` has the sparse MoE block (else the dense MLP)."""
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0

    @property
    def checkpoint_block(self) -> str:
        """The name of a sparse layer's block in checkpoints (``model.layers.{i}.<block>``)."""
        return "block_sparse_moe" if self.checkpoint_names == "mixtral" else "mlp"

    @property
    def checkpoint_expert_names(self) -> tuple[str, str, str]:
        """Checkpoint names of an expert's gate, up and down projections."""
        if self.checkpoint_names == "mixtral":
            return ("w1", "w3", "w2")
        return ("gate_proj", "up_proj", "down_proj")

    def split_fused_experts(self, num_layers: int, weights: dict[str, Any]) -> None:
        """In place: replace each sparse layer's fused ``experts.gate_up_proj`` ``[E, 2I, H]`` and
        ``experts.down_proj`` ``[E, H, I]`` tensors (transformers 5's names, under ``mlp.``) by the
        per-expert names of :meth:`expert_weight_shapes` (views, no copy); a Mixtral router stored
        as ``mlp.gate.weight`` moves to ``block_sparse_moe.gate.weight``. Shapes are checked later,
        against :meth:`expert_weight_shapes`."""
        block = self.checkpoint_block
        gate_name, up_name, down_name = self.checkpoint_expert_names
        for i in range(num_layers):
            if not self.is_sparse_layer(i):
                continue
            p = f"model.layers.{i}."
            for stored in ("mlp.", "block_sparse_moe."):
                for suffix in ("", ".weight"):
                    gate_up_key = f"{p}{stored}experts.gate_up_proj{suffix}"
                    down_key = f"{p}{stored}experts.down_proj{suffix}"
                    if gate_up_key not in weights and down_key not in weights:
                        continue
                    if gate_up_key not in weights or down_key not in weights:
                        raise ValueError(
                            f"layer {i}: the checkpoint has only one of {gate_up_key} and {down_key}."
                        )
                    gate_up, down = weights.pop(gate_up_key), weights.pop(down_key)
                    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] % 2:
                        raise ValueError(
                            f"layer {i}: fused experts of shapes {tuple(gate_up.shape)} and "
                            f"{tuple(down.shape)} are not [E, 2I, H] and [E, H, I]."
                        )
                    half = gate_up.shape[1] // 2
                    for e in range(gate_up.shape[0]):
                        weights[f"{p}{block}.experts.{e}.{gate_name}.weight"] = gate_up[e, :half]
                        weights[f"{p}{block}.experts.{e}.{up_name}.weight"] = gate_up[e, half:]
                        weights[f"{p}{block}.experts.{e}.{down_name}.weight"] = down[e]
            if block != "mlp" and p + "mlp.gate.weight" in weights:
                weights[f"{p}{block}.gate.weight"] = weights.pop(p + "mlp.gate.weight")

    def expert_weight_shapes(self, prefix: str, hidden: int) -> dict[str, tuple[int, ...]]:
        """Checkpoint names and shapes of one sparse layer's block (``prefix`` is ``model.layers.{i}.``),
        experts stored one by one (:meth:`split_fused_experts` brings fused checkpoints to this
        form)."""
        i, s = self.intermediate_size, self.shared_expert_intermediate_size
        block, names = f"{prefix}{self.checkpoint_block}.", self.checkpoint_expert_names
        shapes: dict[str, tuple[int, ...]] = {block + "gate.weight": (self.num_experts, hidden)}
        for e in range(self.num_experts):
            shapes[f"{block}experts.{e}.{names[0]}.weight"] = (i, hidden)
            shapes[f"{block}experts.{e}.{names[1]}.weight"] = (i, hidden)
            shapes[f"{block}experts.{e}.{names[2]}.weight"] = (hidden, i)
        if s:
            shapes[block + "shared_expert.gate_proj.weight"] = (s, hidden)
            shapes[block + "shared_expert.up_proj.weight"] = (s, hidden)
            shapes[block + "shared_expert.down_proj.weight"] = (hidden, s)
            shapes[block + "shared_expert_gate.weight"] = (1, hidden)
        return shapes


def moe_config_from_hf(arch: str, hf: dict[str, Any]) -> MoeConfig | None:
    """The :class:`MoeConfig` of a Hugging Face config (None for a dense architecture, and for a Qwen
    MoE config with ``num_experts`` 0, whose layers are all dense)."""
    if arch == "mixtral":
        return MoeConfig(
            num_experts=int(hf.get("num_local_experts") or hf.get("num_experts") or 8),
            top_k=int(hf.get("num_experts_per_tok") or 2),
            intermediate_size=int(hf["intermediate_size"]),
            norm_topk_prob=True,  # Mixtral always renormalises over its top-k
            checkpoint_names="mixtral",
        )
    if arch not in ("qwen2_moe", "qwen3_moe"):
        return None
    qwen2 = arch == "qwen2_moe"
    # transformers' Qwen3-MoE config writes ``num_experts`` as ``num_local_experts``.
    num_experts = int(hf.get("num_experts", hf.get("num_local_experts", 60 if qwen2 else 128)))
    if num_experts == 0:
        return None
    shared = hf.get("shared_expert_intermediate_size", 5632) if qwen2 else 0
    return MoeConfig(
        num_experts=num_experts,
        top_k=int(hf.get("num_experts_per_tok") or (4 if qwen2 else 8)),
        intermediate_size=int(hf.get("moe_intermediate_size") or (1408 if qwen2 else 768)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        checkpoint_names="qwen",
        shared_expert_intermediate_size=int(shared or 0),
        decoder_sparse_step=int(hf.get("decoder_sparse_step") or 1),
        mlp_only_layers=list(hf.get("mlp_only_layers") or []),
    )
