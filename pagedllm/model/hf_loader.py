"""Load Hugging Face model directories (``config.json`` + ``*.safetensors``) as float32 weights."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import load_file

from pagedllm.model.config import ModelConfig

# Buffers some checkpoints include that are recomputed at load time, never parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_json(path: str) -> dict[str, Any]:
    """Parse a JSON object file, with the path in any error."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"Could not read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not contain a JSON object.")
    return data


def load_hf_config(model_dir: str) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face model directory.

    ``eos_token_ids`` comes from ``generation_config.json`` when it names any, else ``config.json``.
    """
    config = ModelConfig.from_hf_config(read_json(os.path.join(model_dir, "config.json")))
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        generation = read_json(gen_path)
        eos = generation.get("eos_token_id")
        if eos is not None:
            config.eos_token_ids = [eos] if isinstance(eos, int) else [int(i) for i in eos]
        if config.bos_token_id is None:
            config.bos_token_id = generation.get("bos_token_id")
    return config


def load_safetensors_float32(model_dir: str, rename: Callable[[str], str | None]) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's ``*.safetensors`` files as contiguous float32, under the name
    ``rename`` gives it (None: skipped). A name found twice is a ValueError; no file at all is a
    FileNotFoundError."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"No *.safetensors files in model directory {model_dir}.")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        for stored, tensor in load_file(file).items():
            name = rename(stored)
            if name is None:
                continue
            if name in weights:
                raise ValueError(f"Tensor {name} appears more than once in {model_dir}.")
            weights[name] = tensor.to(torch.float32).contiguous()
    return weights


def load_hf_weights(model_dir: str, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's ``*.safetensors`` files, as float32, checked against ``config``.

    When the embeddings are tied, a stored ``lm_head.weight`` is dropped; when the checkpoint has no
    ``lm_head.weight`` at all, ``config.tie_word_embeddings`` is set (the model cannot be untied).
    """
    weights = load_safetensors_float32(
        model_dir, lambda name: None if name.endswith(_IGNORED_SUFFIXES) else name
    )
    if "lm_head.weight" not in weights:
        config.tie_word_embeddings = True
    elif config.tie_word_embeddings:
        del weights["lm_head.weight"]
    config.check_weights(weights, model_dir)
    return weights


def load_hf(model_dir: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and float32 weights of a Hugging Face model directory."""
    config = load_hf_config(model_dir)
    return config, load_hf_weights(model_dir, config)
