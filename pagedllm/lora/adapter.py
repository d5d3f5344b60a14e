"""Reading an adapter into memory: PEFT folders, checked against the base model before anything changes.

A PEFT LoRA folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` with, per targeted
projection, ``...layers.{i}.{self_attn|mlp}.{name}.lora_A.weight`` (``[r, in]``) and ``lora_B.weight``
(``[out, r]``). The adapter adds ``scaling * B @ A`` to the projection's weight, ``scaling`` being
``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``). B is stored here already scaled.

Everything an adapter may hold that the engine does not apply is refused with an error naming it
(DoRA, embedding or LM-head targets, biases, modules to save, per-module ranks, projections the model
lacks, shapes that do not fit the model, a rank above ``max_lora_rank``): a wrong answer is worse
than a refusal.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file

from pagedllm.lora.peft_config import read_adapter_config, refuse
from pagedllm.lora.targets import FUSED_NAMES, Target, model_targets
from pagedllm.lora_request import LoRARequest
from pagedllm.model.config import ModelConfig

_KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class SubLoRA:
    """One sub-projection's low-rank pair: ``delta_W = b @ a``."""

    a: torch.Tensor  # [rank, in_features] float32
    b: torch.Tensor  # [out_features, rank] float32, the adapter's scaling applied


@dataclass
class LoRAAdapter:
    """An adapter read and checked against a model: per decoder layer and fused module, the pair of
    each sub-projection it targets (None for the ones it leaves alone)."""

    request: LoRARequest
    rank: int
    scaling: float
    # (layer index, fused module e.g. "self_attn.qkv_proj") -> one entry per sub-projection
    modules: dict[tuple[int, str], list[SubLoRA | None]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of its weights as held (float32)."""
        return sum(
            s.a.numel() * s.a.element_size() + s.b.numel() * s.b.element_size()
            for subs in self.modules.values()
            for s in subs
            if s is not None
        )


def load_adapter(request: LoRARequest, cfg: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """Read ``request``'s adapter for a model of ``cfg``; RequestError (field ``lora_path``) naming
    what is wrong, having changed nothing."""
    files = read_adapter_config(request, max_lora_rank)
    try:
        tensors = load_file(str(files.weights_path))
    except Exception as exc:  # safetensors raises its own error types
        raise refuse(
            f"LoRA adapter {request.lora_name!r}: {files.weights_path} is not a readable safetensors file ({exc})."
        ) from None
    adapter = LoRAAdapter(request, files.rank, files.scaling)
    _collect(adapter, tensors, cfg, files.targets)
    return adapter


def _collect(
    adapter: LoRAAdapter, tensors: dict[str, torch.Tensor], cfg: ModelConfig, targets: frozenset[str]
) -> None:
    """Check every tensor of a PEFT file against the model and file it under its fused module."""
    name = adapter.request.lora_name
    known = model_targets(cfg)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            if "lora_magnitude_vector" in key:
                raise refuse(f"LoRA adapter {name!r}: {key} is a DoRA magnitude; DoRA is not supported.")
            raise refuse(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA pair of a decoder projection.")
        layer, _, proj, which = int(match[1]), match[2], match[3], match[4]
        if proj in FUSED_NAMES:
            raise refuse(f"LoRA adapter {name!r}: {key}: fused {proj} weights are not supported yet.")
        if proj not in known:
            raise refuse(f"LoRA adapter {name!r}: {key} targets {proj!r}, which this model does not have.")
        if not 0 <= layer < cfg.num_hidden_layers:
            raise refuse(
                f"LoRA adapter {name!r}: {key} names layer {layer}; the model has {cfg.num_hidden_layers}."
            )
        pairs.setdefault((layer, proj), {})[which] = tensor
    if not pairs:
        raise refuse(f"LoRA adapter {name!r}: its weights file holds no LoRA pair.")
    for (layer, proj), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise refuse(f"LoRA adapter {name!r}: layer {layer} {proj} has lora_{''.join(pair)} alone.")
        target: Target = known[proj]
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (adapter.rank, target.in_features) or tuple(b.shape) != (
            target.out_features,
            adapter.rank,
        ):
            raise refuse(
                f"LoRA adapter {name!r}: layer {layer} {proj} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                f"this model needs A ({adapter.rank}, {target.in_features}) and B ({target.out_features}, "
                f"{adapter.rank}) (was it trained on another base model?)."
            )
        if proj not in targets:
            raise refuse(f"LoRA adapter {name!r}: weights for {proj} but target_modules does not list it.")
        subs = adapter.modules.setdefault((layer, target.module), [None] * _num_subs(known, target.module))
        b = b.float() * adapter.scaling
        if cfg.rope_interleaved and proj in ("q_proj", "k_proj"):
            # The model keeps llama.cpp's GGUF order of q/k rows: each head's rotary halves interleaved.
            heads = cfg.num_attention_heads if proj == "q_proj" else cfg.num_key_value_heads
            b = interleave_rotary_rows(b, heads)
        subs[target.sub] = SubLoRA(a.float().contiguous(), b.contiguous())


def interleave_rotary_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """HF's q/k output rows ``(head, half, i)`` in llama.cpp's GGUF order ``(head, i, half)`` (the
    inverse of :func:`pagedllm.model.gguf_loader.unpermute_rotary_rows`)."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, 2, half, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def _num_subs(known: dict[str, Target], module: str) -> int:
    return sum(1 for t in known.values() if t.module == module)
