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

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from pagedllm.errors import RequestError
from pagedllm.lora.targets import FUSED_NAMES, TARGET_NAMES, Target, model_targets
from pagedllm.lora_request import LoRARequest
from pagedllm.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# adapter_config.json keys that change what the adapter computes, with the value that means "off".
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "use_dora": (False, None),
    "modules_to_save": (None, []),
    "rank_pattern": (None, {}),
    "alpha_pattern": (None, {}),
    "layers_to_transform": (None, []),
    "layers_pattern": (None, [], ""),
    "fan_in_fan_out": (False, None),
    "lora_bias": (False, None),
    "trainable_token_indices": (None, {}, []),
}
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


def _refuse(message: str) -> RequestError:
    return RequestError("lora_path", message)


def load_adapter(request: LoRARequest, cfg: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """Read ``request``'s adapter for a model of ``cfg``; RequestError (field ``lora_path``) naming
    what is wrong, having changed nothing."""
    path = Path(request.lora_path)
    name = request.lora_name
    if path.is_file() and path.suffix == ".gguf":
        raise _refuse(
            f"LoRA adapter {name!r}: {path} is a GGUF adapter; this version reads PEFT folders only "
            f"({CONFIG_FILE} + {WEIGHTS_FILE})."
        )
    if not path.is_dir():
        raise _refuse(
            f"LoRA adapter {name!r}: {request.lora_path} is neither a PEFT folder nor a .gguf file."
        )
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise _refuse(f"LoRA adapter {name!r}: {path} has no {CONFIG_FILE} (a PEFT LoRA folder has one).")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise _refuse(f"LoRA adapter {name!r}: {config_path} is not readable JSON ({exc}).") from None
    rank, scaling, targets = _check_config(name, config, cfg, max_lora_rank)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        if (path / "adapter_model.bin").is_file():
            raise _refuse(
                f"LoRA adapter {name!r}: {path} holds adapter_model.bin (a pickle, which is not loaded "
                f"for safety); save it as {WEIGHTS_FILE} (PEFT's default, safe_serialization=True)."
            )
        raise _refuse(f"LoRA adapter {name!r}: {path} has no {WEIGHTS_FILE}.")
    try:
        tensors = load_file(str(weights_path))
    except Exception as exc:  # safetensors raises its own error types
        raise _refuse(
            f"LoRA adapter {name!r}: {weights_path} is not a readable safetensors file ({exc})."
        ) from None
    adapter = LoRAAdapter(request, rank, scaling)
    _collect(adapter, tensors, cfg, targets)
    return adapter


def scaling_of(rank: int, alpha: float, rslora: bool) -> float:
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def _check_config(
    name: str, config: dict[str, Any], cfg: ModelConfig, max_lora_rank: int
) -> tuple[int, float, set[str]]:
    """``(rank, scaling, targeted projection names)`` of a PEFT config, or a RequestError."""
    kind = config.get("peft_type")
    if kind != "LORA":
        raise _refuse(f"LoRA adapter {name!r}: peft_type is {kind!r}; only 'LORA' adapters are supported.")
    for key, off in _OFF_VALUES.items():
        if config.get(key) not in off:
            raise _refuse(f"LoRA adapter {name!r}: {key}={config[key]!r} is not supported.")
    bias = config.get("bias", "none")
    if bias != "none":
        raise _refuse(f"LoRA adapter {name!r}: bias={bias!r} is not supported (only 'none').")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _refuse(f"LoRA adapter {name!r}: r must be a positive integer, got {rank!r}.")
    if rank > max_lora_rank:
        raise _refuse(f"LoRA adapter {name!r}: rank {rank} is above max_lora_rank={max_lora_rank}.")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise _refuse(f"LoRA adapter {name!r}: lora_alpha must be a number, got {alpha!r}.")
    raw = config.get("target_modules")
    if isinstance(raw, str):
        raise _refuse(
            f"LoRA adapter {name!r}: target_modules as a pattern ({raw!r}) is not supported; list the "
            f"projections ({', '.join(TARGET_NAMES)})."
        )
    if not isinstance(raw, list) or not raw:
        raise _refuse(f"LoRA adapter {name!r}: target_modules must list the projections, got {raw!r}.")
    targets: set[str] = set()
    for module in raw:
        if module in FUSED_NAMES:
            targets.update(FUSED_NAMES[module])
        elif module in TARGET_NAMES:
            targets.add(module)
        else:
            raise _refuse(
                f"LoRA adapter {name!r}: target module {module!r} is not supported (supported: "
                f"{', '.join(TARGET_NAMES)}; embeddings and the LM head are not)."
            )
    return rank, scaling_of(rank, float(alpha), bool(config.get("use_rslora", False))), targets


def _collect(
    adapter: LoRAAdapter, tensors: dict[str, torch.Tensor], cfg: ModelConfig, targets: set[str]
) -> None:
    """Check every tensor of a PEFT file against the model and file it under its fused module."""
    name = adapter.request.lora_name
    known = model_targets(cfg)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            if "lora_magnitude_vector" in key:
                raise _refuse(f"LoRA adapter {name!r}: {key} is a DoRA magnitude; DoRA is not supported.")
            raise _refuse(
                f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA pair of a decoder projection."
            )
        layer, _, proj, which = int(match[1]), match[2], match[3], match[4]
        if proj in FUSED_NAMES:
            raise _refuse(f"LoRA adapter {name!r}: {key}: fused {proj} weights are not supported yet.")
        if proj not in known:
            raise _refuse(f"LoRA adapter {name!r}: {key} targets {proj!r}, which this model does not have.")
        if not 0 <= layer < cfg.num_hidden_layers:
            raise _refuse(
                f"LoRA adapter {name!r}: {key} names layer {layer}; the model has {cfg.num_hidden_layers}."
            )
        pairs.setdefault((layer, proj), {})[which] = tensor
    if not pairs:
        raise _refuse(f"LoRA adapter {name!r}: its weights file holds no LoRA pair.")
    for (layer, proj), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise _refuse(f"LoRA adapter {name!r}: layer {layer} {proj} has lora_{''.join(pair)} alone.")
        target: Target = known[proj]
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (adapter.rank, target.in_features) or tuple(b.shape) != (
            target.out_features,
            adapter.rank,
        ):
            raise _refuse(
                f"LoRA adapter {name!r}: layer {layer} {proj} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                f"this model needs A ({adapter.rank}, {target.in_features}) and B ({target.out_features}, "
                f"{adapter.rank}) (was it trained on another base model?)."
            )
        if proj not in targets:
            raise _refuse(f"LoRA adapter {name!r}: weights for {proj} but target_modules does not list it.")
        subs = adapter.modules.setdefault((layer, target.module), [None] * _num_subs(known, target.module))
        subs[target.sub] = SubLoRA(a.float().contiguous(), (b.float() * adapter.scaling).contiguous())


def _num_subs(known: dict[str, Target], module: str) -> int:
    return sum(1 for t in known.values() if t.module == module)
