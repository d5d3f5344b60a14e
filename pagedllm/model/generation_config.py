"""Default sampling parameters from a model's generation config (the ``generation_config`` engine
argument, ``--generation-config auto|vllm|FOLDER``).

* ``auto``: a Hugging Face model directory's ``generation_config.json``, or a GGUF file's
  ``general.sampling.*`` metadata, or for a shipped file without them its model card's values
  (:data:`MODEL_CARD_DEFAULTS`: the default model samples at temperature 0.2, top_p 0.9); a model
  without any has no defaults.
* ``vllm``: no model defaults; the built-in neutral values of :class:`SamplingParams` apply.
* a folder: that folder's ``generation_config.json`` (it must exist).

Only the five fields of :data:`GENERATION_FIELDS` are read (a field that is absent or ``null`` is
not a default); other keys (``do_sample``, ``max_new_tokens``, token ids) are not sampling defaults
here. Every value read is checked as :class:`SamplingParams` checks it, and a bad one is a
``ValueError`` naming ``generation_config`` and the file, raised before any weight is loaded.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gguf import GGUFValueType, Keys

from pagedllm.model.gguf_scan import GGUFScanner
from pagedllm.model.hf_loader import read_json
from pagedllm.model.loader import DEFAULT_MODEL_FILE, resolve_model_path
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# Sampling defaults of shipped model files that carry none in their metadata, by file name, from
# their model cards: SmolLM2-135M-Instruct's card samples with temperature 0.2 and top_p 0.9 (at the
# neutral temperature 1.0 the 135M model's replies are mostly word salad).
MODEL_CARD_DEFAULTS: dict[str, dict[str, float | int]] = {
    DEFAULT_MODEL_FILE: {"temperature": 0.2, "top_p": 0.9},
}
GENERATION_CONFIG_FILE = "generation_config.json"

# GGUF metadata key -> SamplingParams field (llama.cpp's names for the same defaults).
GGUF_SAMPLING_KEYS = {
    Keys.General.SAMPLING_TEMP: "temperature",
    Keys.General.SAMPLING_TOP_P: "top_p",
    Keys.General.SAMPLING_TOP_K: "top_k",
    Keys.General.SAMPLING_MIN_P: "min_p",
    Keys.General.SAMPLING_PENALTY_REPEAT: "repetition_penalty",
}


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling defaults found (a subset of :data:`GENERATION_FIELDS`, valid for
    :class:`SamplingParams`) and where they came from (for logs)."""

    values: dict[str, float | int] = field(default_factory=dict)
    source: str = "none"


def load_generation_defaults(setting: str, model: str | None) -> GenerationDefaults:
    """The defaults ``setting`` (``auto``, ``vllm`` or a folder) selects for ``model`` (a model argument,
    as :func:`resolve_model_path` takes). Logs what was taken from where."""
    if setting == "vllm":
        defaults = GenerationDefaults(source="generation_config=vllm")
    elif setting == "auto":
        kind, path = resolve_model_path(model)
        if kind == "gguf":
            metadata = read_gguf_metadata(path, GGUF_SAMPLING_KEYS.__contains__)
            values = {
                GGUF_SAMPLING_KEYS[k]: _f32(v) if isinstance(v, float) else v for k, v in metadata.items()
            }
            card = MODEL_CARD_DEFAULTS.get(os.path.basename(path))
            if not values and card is not None:
                defaults = GenerationDefaults(dict(card), f"{os.path.basename(path)}'s model card")
            else:
                defaults = GenerationDefaults(
                    _checked(values, f"{path} (general.sampling.*)"), f"{path} metadata"
                )
        else:
            config_path = os.path.join(path, GENERATION_CONFIG_FILE)
            found = os.path.isfile(config_path)
            defaults = GenerationDefaults(_read_config_file(config_path) if found else {}, config_path)
    else:
        folder = os.path.abspath(os.path.expanduser(setting))
        if not os.path.isdir(folder):
            raise ValueError(
                f"generation_config must be 'auto', 'vllm' or a folder; no such folder: {setting!r}."
            )
        config_path = os.path.join(folder, GENERATION_CONFIG_FILE)
        if not os.path.isfile(config_path):
            raise ValueError(f"generation_config: the folder {setting!r} has no {GENERATION_CONFIG_FILE}.")
        defaults = GenerationDefaults(_read_config_file(config_path), config_path)
    if defaults.values:
        shown = ", ".join(f"{k}={v}" for k, v in defaults.values.items())
        logger.info(
            "Default sampling parameters from %s: %s (a request's own values win).", defaults.source, shown
        )
    else:
        logger.info("No default sampling parameters (%s): the built-in defaults apply.", defaults.source)
    return defaults


def _read_config_file(path: str) -> dict[str, float | int]:
    try:
        data = read_json(path)
    except ValueError as exc:
        raise ValueError(f"generation_config: {exc}") from None
    return _checked({k: data[k] for k in GENERATION_FIELDS if data.get(k) is not None}, path)


def _checked(values: dict[str, Any], where: str) -> dict[str, float | int]:
    """``values`` in :data:`GENERATION_FIELDS` order, checked as SamplingParams checks them."""
    for name, value in values.items():
        integer = name == "top_k"
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            kind = "an integer" if integer else "a number"
            raise ValueError(f"generation_config: {where}: {name} must be {kind}, got {value!r}.")
    try:
        SamplingParams(**values)
    except ValueError as exc:
        raise ValueError(f"generation_config: {where}: {exc}") from None
    return {name: values[name] for name in GENERATION_FIELDS if name in values}


def _f32(value: float) -> float:
    """A float32 metadata value as the short decimal it was written from (0.60000002 -> 0.6)."""
    return float(f"{value:.7g}")


# -- a GGUF metadata scan that decodes only the keys asked for --------------------------------------
# (GGUFReader decodes every key, the tokenizer's vocabulary included, which costs a large part of a
# second on a small model's file; here the other values are only stepped over.)


def read_gguf_metadata(path: str, wanted: Callable[[str], bool]) -> dict[str, Any]:
    """The metadata values of the GGUF file ``path`` whose keys ``wanted`` accepts, decoded as
    ``GGUFReader`` decodes them (arrays as lists, strings as text). Raises ValueError for a file that
    is not GGUF (version 2 or 3)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if len(data) < 24 or data[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file.")
        order = "<"
        (version,) = struct.unpack_from("<I", data, 4)
        if version & 0xFFFF == 0:  # written big-endian
            order = ">"
            (version,) = struct.unpack_from(">I", data, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3).")
        (num_kv,) = struct.unpack_from(order + "Q", data, 16)
        reader = GGUFScanner(data, order, 24)
        out: dict[str, Any] = {}
        for _ in range(num_kv):
            key = reader.string()
            kind = GGUFValueType(reader.scalar("I"))
            if wanted(key):
                out[key] = reader.value(kind)
            else:
                reader.skip(kind)
        return out
