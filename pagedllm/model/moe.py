"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE) over the engine's flat token batch.

A sparse layer's MLP is :class:`SparseMoeBlock`: router logits (``gate``, ``[hidden] -> [E]``), a
float32 softmax, the ``top_k`` most probable experts per token (renormalised to sum to 1 when the
config says so; Mixtral always does), each a SwiGLU MLP, and their outputs summed with those weights.
Qwen2-MoE adds a shared expert run for every token and scaled by ``sigmoid(shared_expert_gate(x))``.
Layers listed in ``mlp_only_layers``, or skipped by ``decoder_sparse_step``, keep the dense MLP.

Expert weights are stacked per layer: ``experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up
rows) and ``experts.down_proj`` ``[E, H, I]``, the layout of transformers' fused experts. The expert
products run with no per-token Python loop: on CUDA the Triton grouped GEMM of
:mod:`pagedllm.kernels.triton.fused_moe` (:func:`fused_experts`); on the CPU in float32 the native
grouped product of :mod:`pagedllm.kernels.cpu.moe`, over expert weights packed once into the panel
layout of the dense layers (:func:`pack_cpu_experts`, which releases the stacked tensors);
elsewhere :func:`experts_torch` (tokens sorted by expert, one matrix product per expert that
received tokens).

Checkpoints name experts one by one (Mixtral ``block_sparse_moe.experts.{e}.w1/w3/w2``, Qwen
``mlp.experts.{e}.gate_proj/up_proj/down_proj``) or fused (``mlp.experts.gate_up_proj`` /
``down_proj``); ``MoeConfig.split_fused_experts`` brings the fused form to the per-expert names the
config checks, and :meth:`MoeForCausalLM.load_weights` stacks them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.cpu import moe as cpu_moe
from pagedllm.model.config import ModelConfig
from pagedllm.model.layers import silu_and_mul
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.moe_config import MoeConfig


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, expert_ids)``, each ``[tokens, top_k]``: the ``top_k`` largest softmax
    probabilities of each row of ``router_logits`` (computed in float32), most probable first, and
    their expert ids (int64). With ``renormalize`` the weights of a row sum to 1. Weights are float32.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_torch(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` for every row ``t`` of ``x``, with
    ``expert_e(v) = down[e] @ (silu(g) * u)`` where ``[g; u] = gate_up[e] @ v``.

    Token/expert pairs are sorted by expert and each expert that received any runs one matrix product
    over its rows (the torch fallback of the native and Triton kernels; any device and dtype).
    """
    tokens, top_k = topk_ids.shape
    out = torch.zeros_like(x)
    if tokens == 0:
        return out
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    rows = order // top_k
    sorted_x = x.index_select(0, rows)
    y = torch.empty_like(sorted_x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        h = silu_and_mul(F.linear(sorted_x[start:end], gate_up[expert]))
        y[start:end] = F.linear(h, down[expert])
        start = end
    y = y * topk_weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    return out.index_add_(0, rows, y)


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """:func:`experts_torch`'s result through the Triton grouped GEMM on CUDA (and on meta tensors,
    which compile it for a GPU inside ``triton_aot.compile_for``), else :func:`experts_torch` itself
    (CPU experts take the native kernel once packed: :meth:`Experts.pack_for_cpu`)."""
    if x.device.type in ("cuda", "meta"):
        from pagedllm.kernels.triton import fused_moe  # needs triton, only imported on a GPU

        if fused_moe.available():
            return fused_moe.fused_experts(x, gate_up, down, topk_weights, topk_ids)
    return experts_torch(x, gate_up, down, topk_weights, topk_ids)


class Experts(nn.Module):
    """The stacked expert weights of one sparse layer: ``gate_up_proj`` ``[E, 2I, H]`` and
    ``down_proj`` ``[E, H, I]``; after :meth:`pack_for_cpu`, the same weights as the native kernel's
    panels (buffers ``gate_up_panels`` / ``down_panels``) and the two parameters emptied."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.packed: cpu_moe.ExpertPanels | None = None

    def pack_for_cpu(self) -> bool:
        """Move float32 CPU experts into the native kernel's panel layout (the original tensors are
        released); returns whether they are packed. Other dtypes and devices are left as they are."""
        if self.packed is None and cpu_moe.usable(self.gate_up_proj, self.down_proj):
            packed = cpu_moe.pack_experts(self.gate_up_proj.data, self.down_proj.data)
            self.register_buffer("gate_up_panels", packed.gate_up, persistent=False)
            self.register_buffer("down_panels", packed.down, persistent=False)
            self.gate_up_proj.data = torch.empty(0)
            self.down_proj.data = torch.empty(0)
            self.packed = packed
        return self.packed is not None

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return cpu_moe.moe_experts_packed(x, self.packed, topk_weights, topk_ids)
        return fused_experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)


def pack_cpu_experts(model: nn.Module) -> int:
    """:meth:`Experts.pack_for_cpu` on every expert set of ``model``; returns how many are packed."""
    return sum(m.pack_for_cpu() for m in model.modules() if isinstance(m, Experts))


class GatedMLP(nn.Module):
    """A SwiGLU MLP of width ``intermediate`` (Qwen2-MoE's shared expert), gate and up fused."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj: nn.Module = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj: nn.Module = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Router, experts and optional shared expert of one sparse layer (see the module docstring)."""

    def __init__(self, moe: MoeConfig, hidden: int) -> None:
        super().__init__()
        self.top_k = moe.top_k
        self.renormalize = moe.norm_topk_prob
        self.gate: nn.Module = nn.Linear(hidden, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, hidden, moe.intermediate_size)
        shared = moe.shared_expert_intermediate_size
        self.shared_expert = GatedMLP(hidden, shared) if shared else None
        self.shared_expert_gate: nn.Module | None = nn.Linear(hidden, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose sparse layers (``config.moe.is_sparse_layer``) have a
    :class:`SparseMoeBlock` as their MLP; the other layers (all of them when ``config.moe`` is None)
    keep the dense MLP."""

    def __init__(self, cfg: ModelConfig, max_position: int) -> None:
        super().__init__(cfg, max_position)
        for i, layer in enumerate(self.layers):
            if cfg.moe is not None and cfg.moe.is_sparse_layer(i):
                layer.mlp = SparseMoeBlock(cfg.moe, cfg.hidden_size)

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load HF-named tensors; each expert is copied straight into its slice of the stacked
        parameters (:func:`stack_expert_weights`), so the experts are never held twice more."""
        into: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                into[f"model.layers.{i}.mlp.experts.gate_up_proj"] = layer.mlp.experts.gate_up_proj
                into[f"model.layers.{i}.mlp.experts.down_proj"] = layer.mlp.experts.down_proj
        # The stacked tensors handed on are the parameters themselves (copy_ of a tensor onto itself
        # returns at once).
        super().load_weights(stack_expert_weights(self.config, weights, into))


def stack_expert_weights(
    config: ModelConfig, weights: dict[str, torch.Tensor], into: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """A new dict with each sparse layer's block under the model's parameter names: the experts
    stacked into ``model.layers.{i}.mlp.experts.gate_up_proj`` ``[E, 2I, H]`` / ``down_proj``
    ``[E, H, I]`` (written into the tensors ``into`` holds under those names when given, else into new
    ones), the router at ``mlp.gate.weight``, the shared expert's gate and up projections fused into
    ``mlp.shared_expert.gate_up_proj.weight``. Accepts per-expert and fused checkpoint forms; other
    tensors pass through. A missing or misshapen expert tensor is a ValueError naming it."""
    moe = config.moe
    if moe is None:
        return dict(weights)
    weights = dict(weights)
    moe.split_fused_experts(config.num_hidden_layers, weights)
    gate_name, up_name, down_name = moe.checkpoint_expert_names
    block = moe.checkpoint_block
    hidden, inter, num_experts = config.hidden_size, moe.intermediate_size, moe.num_experts

    def take(name: str) -> torch.Tensor:
        if name not in weights:
            raise ValueError(f"checkpoint is missing weight {name!r}")
        return weights.pop(name)

    def stacked(name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        target = (into or {}).get(name)
        if target is None:
            return torch.empty(shape, dtype=like.dtype)
        if tuple(target.shape) != shape:
            raise ValueError(f"{name}: the model holds {tuple(target.shape)}, the config says {shape}.")
        return target

    def put(target: torch.Tensor, name: str, tensor: torch.Tensor) -> None:
        if target.shape != tensor.shape:
            raise ValueError(
                f"weight {name}: expected shape {tuple(target.shape)}, got {tuple(tensor.shape)}"
            )
        target.copy_(tensor)

    out: dict[str, torch.Tensor] = {}
    for i in range(config.num_hidden_layers):
        if not moe.is_sparse_layer(i):
            continue
        src, dst = f"model.layers.{i}.{block}.", f"model.layers.{i}.mlp."
        gate_up, down = None, None
        for e in range(num_experts):
            names = [f"{src}experts.{e}.{n}.weight" for n in (gate_name, up_name, down_name)]
            gate, up, down_e = (take(n) for n in names)
            if gate_up is None or down is None:
                gate_up = stacked(dst + "experts.gate_up_proj", (num_experts, 2 * inter, hidden), gate)
                down = stacked(dst + "experts.down_proj", (num_experts, hidden, inter), down_e)
            put(gate_up[e, :inter], names[0], gate)
            put(gate_up[e, inter:], names[1], up)
            put(down[e], names[2], down_e)
        assert gate_up is not None and down is not None
        out[dst + "experts.gate_up_proj"] = gate_up
        out[dst + "experts.down_proj"] = down
        out[dst + "gate.weight"] = take(src + "gate.weight")
        if moe.shared_expert_intermediate_size:
            shared_gate = take(src + "shared_expert.gate_proj.weight")
            shared_up = take(src + "shared_expert.up_proj.weight")
            out[dst + "shared_expert.gate_up_proj.weight"] = torch.cat([shared_gate, shared_up], dim=0)
            out[dst + "shared_expert.down_proj.weight"] = take(src + "shared_expert.down_proj.weight")
            out[dst + "shared_expert_gate.weight"] = take(src + "shared_expert_gate.weight")
    out.update(weights)
    return out


def is_moe_model(model: nn.Module) -> bool:
    """Whether ``model`` has any :class:`SparseMoeBlock`."""
    return any(isinstance(m, SparseMoeBlock) for m in model.modules())
