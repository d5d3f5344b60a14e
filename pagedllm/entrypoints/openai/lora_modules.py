"""``--lora-modules``: the adapters a server serves, by the names requests give in ``model``.

Each value is ``name=path`` or vLLM's JSON form ``{"name": ..., "path": ..., "base_model_name": ...}``.
Adapters get the integer ids 1, 2, ... in the order given. Each folder and configuration is checked at
start-up (:func:`pagedllm.lora.peft_config.read_adapter_config`); the weights are read and checked
against the model by the engine on the adapter's first request (a 400 naming ``lora_path`` if they
do not fit). Requests naming an adapter run with it, and ``/v1/models`` lists it with the base model
as its ``parent``.
"""

from __future__ import annotations

import json
import os

from pagedllm.errors import RequestError
from pagedllm.lora.peft_config import read_adapter_config
from pagedllm.lora_request import LoRARequest


def parse_lora_modules(
    values: list[str] | None, enable_lora: bool, served_names: list[str], max_lora_rank: int
) -> dict[str, LoRARequest]:
    """The adapters of ``--lora-modules`` by name; ValueError naming the flag and the value at fault."""
    if not values:
        return {}
    if not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora.")
    modules: dict[str, LoRARequest] = {}
    for value in values:
        name, path, base = _parse_one(value)
        if name in modules or name in served_names:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice (or is the base model's).")
        if not os.path.exists(path):
            raise ValueError(f"--lora-modules: {name}={path}: no such file or folder.")
        lora = LoRARequest(name, len(modules) + 1, path, base)
        try:
            read_adapter_config(lora, max_lora_rank)
        except RequestError as exc:
            raise ValueError(f"--lora-modules: {exc}") from None
        modules[name] = lora
    return modules


def _parse_one(value: str) -> tuple[str, str, str | None]:
    if value.lstrip().startswith("{"):
        try:
            spec = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"--lora-modules: {value!r} is not valid JSON ({exc}).") from None
        if (
            not isinstance(spec, dict)
            or not isinstance(spec.get("name"), str)
            or not isinstance(spec.get("path"), str)
        ):
            raise ValueError(f"--lora-modules: {value!r} needs string fields 'name' and 'path'.")
        unknown = set(spec) - {"name", "path", "base_model_name"}
        if unknown:
            raise ValueError(f"--lora-modules: {value!r} has unknown field(s) {sorted(unknown)}.")
        base = spec.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules: base_model_name must be a string in {value!r}.")
        return spec["name"].strip(), spec["path"], base
    name, sep, path = value.partition("=")
    if not sep or not name.strip() or not path:
        raise ValueError(f"--lora-modules: {value!r} is neither NAME=PATH nor a JSON object.")
    return name.strip(), path, None
