"""An adapter's files and configuration, checked without reading its weights (and without torch):
what the server checks of ``--lora-modules`` and of adapters loaded at run time, and the first part
of :func:`pagedllm.lora.adapter.load_adapter`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.errors import RequestError
from pagedllm.lora.targets import FUSED_NAMES, TARGET_NAMES
from pagedllm.lora_request import LoRARequest

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


@dataclass(frozen=True)
class AdapterFiles:
    """A PEFT folder whose configuration the engine can apply."""

    weights_path: Path
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    targets: frozenset[str]  # the projections it lists (fused names expanded)


def refuse(message: str) -> RequestError:
    return RequestError("lora_path", message)


def read_adapter_config(request: LoRARequest, max_lora_rank: int) -> AdapterFiles:
    """Check ``request``'s folder and configuration; RequestError (field ``lora_path``) naming what
    is wrong."""
    path = Path(request.lora_path)
    name = request.lora_name
    if path.is_file() and path.suffix == ".gguf":
        raise refuse(
            f"LoRA adapter {name!r}: {path} is a GGUF adapter; this version reads PEFT folders only "
            f"({CONFIG_FILE} + {WEIGHTS_FILE})."
        )
    if not path.is_dir():
        raise refuse(f"LoRA adapter {name!r}: {request.lora_path} is neither a PEFT folder nor a .gguf file.")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise refuse(f"LoRA adapter {name!r}: {path} has no {CONFIG_FILE} (a PEFT LoRA folder has one).")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise refuse(f"LoRA adapter {name!r}: {config_path} is not readable JSON ({exc}).") from None
    if not isinstance(config, dict):
        raise refuse(f"LoRA adapter {name!r}: {config_path} does not hold a JSON object.")
    rank, scaling, targets = _check_config(name, config, max_lora_rank)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        if (path / "adapter_model.bin").is_file():
            raise refuse(
                f"LoRA adapter {name!r}: {path} holds adapter_model.bin (a pickle, which is not loaded "
                f"for safety); save it as {WEIGHTS_FILE} (PEFT's default, safe_serialization=True)."
            )
        raise refuse(f"LoRA adapter {name!r}: {path} has no {WEIGHTS_FILE}.")
    return AdapterFiles(weights_path, rank, scaling, frozenset(targets))


def scaling_of(rank: int, alpha: float, rslora: bool) -> float:
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def _check_config(name: str, config: dict[str, Any], max_lora_rank: int) -> tuple[int, float, set[str]]:
    """``(rank, scaling, targeted projection names)`` of a PEFT config, or a RequestError."""
    kind = config.get("peft_type")
    if kind != "LORA":
        raise refuse(f"LoRA adapter {name!r}: peft_type is {kind!r}; only 'LORA' adapters are supported.")
    for key, off in _OFF_VALUES.items():
        if config.get(key) not in off:
            raise refuse(f"LoRA adapter {name!r}: {key}={config[key]!r} is not supported.")
    bias = config.get("bias", "none")
    if bias != "none":
        raise refuse(f"LoRA adapter {name!r}: bias={bias!r} is not supported (only 'none').")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise refuse(f"LoRA adapter {name!r}: r must be a positive integer, got {rank!r}.")
    if rank > max_lora_rank:
        raise refuse(f"LoRA adapter {name!r}: rank {rank} is above max_lora_rank={max_lora_rank}.")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise refuse(f"LoRA adapter {name!r}: lora_alpha must be a number, got {alpha!r}.")
    raw = config.get("target_modules")
    if isinstance(raw, str):
        raise refuse(
            f"LoRA adapter {name!r}: target_modules as a pattern ({raw!r}) is not supported; list the "
            f"projections ({', '.join(TARGET_NAMES)})."
        )
    if not isinstance(raw, list) or not raw:
        raise refuse(f"LoRA adapter {name!r}: target_modules must list the projections, got {raw!r}.")
    targets: set[str] = set()
    for module in raw:
        if module in FUSED_NAMES:
            targets.update(FUSED_NAMES[module])
        elif module in TARGET_NAMES:
            targets.add(module)
        else:
            raise refuse(
                f"LoRA adapter {name!r}: target module {module!r} is not supported (supported: "
                f"{', '.join(TARGET_NAMES)}; embeddings and the LM head are not)."
            )
    return rank, scaling_of(rank, float(alpha), bool(config.get("use_rslora", False))), targets
