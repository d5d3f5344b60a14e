"""Load Hugging Face model directories (``config.json`` + ``*.safetensors``) as float32 weights.

Every loader takes an optional ``select`` (a :data:`TensorSelector`) that reads only a slice of each
tensor, for ranks of a tensor- or pipeline-parallel run that each hold a shard.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable
from typing import Any, TypeAlias

import torch
from safetensors import safe_open

from pagedllm.model.config import ModelConfig

TensorSelector: TypeAlias = Callable[[str, tuple[int, ...]], tuple[slice, ...] | None]
"""Which part of a checkpoint tensor to load: called with the tensor's Hugging Face name (after
renaming, e.g. ``model.layers.3.self_attn.q_proj.weight``) and its full shape in Hugging Face layout
(``[out, in]`` for a 2-D weight); returns None to skip the tensor (not read, not in the returned
weights), ``()`` for the whole tensor, or step-1 slices of its leading dimensions (``(slice(a, b),)``:
rows ``a:b``; ``(slice(None), slice(a, b))``: columns ``a:b``)."""

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


def check_selection(name: str, shape: tuple[int, ...], index: Any) -> tuple[slice, ...]:
    """``index`` (what a :data:`TensorSelector` returned for tensor ``name`` of full ``shape``, not None)
    as a tuple of step-1 slices of at most ``len(shape)`` leading dimensions; ValueError otherwise."""
    if not isinstance(index, tuple) or len(index) > len(shape):
        raise ValueError(
            f"The selection {index!r} for tensor {name} of shape {shape} is not a tuple of at most "
            f"{len(shape)} slices."
        )
    for item in index:
        if not isinstance(item, slice) or item.step not in (None, 1):
            raise ValueError(f"The selection {index!r} for tensor {name} is not made of step-1 slices.")
    return index


def is_whole(index: tuple[slice, ...], shape: tuple[int, ...]) -> bool:
    """Whether the step-1 slices ``index`` select all of a tensor of ``shape``."""
    return all(s.indices(n)[:2] == (0, n) for s, n in zip(index, shape, strict=False))


def _read_safetensors(
    model_dir: str, rename: Callable[[str], str | None], select: TensorSelector | None
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, ...]]]:
    """The selected tensors of the directory's ``*.safetensors`` files (contiguous float32) and the
    full shape of every renamed tensor in the files (selected or skipped)."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"No *.safetensors files in model directory {model_dir}.")
    weights: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(file, "pt") as f:
            for stored in f.keys():
                name = rename(stored)
                if name is None:
                    continue
                if name in shapes:
                    raise ValueError(f"Tensor {name} appears more than once in {model_dir}.")
                if select is None:
                    tensor = f.get_tensor(stored)
                    shapes[name] = tuple(tensor.shape)
                else:
                    sl = f.get_slice(stored)
                    shape = tuple(int(d) for d in sl.get_shape())
                    shapes[name] = shape
                    chosen = select(name, shape)
                    if chosen is None:
                        continue
                    index = check_selection(name, shape, chosen)
                    if not is_whole(index, shape):
                        # A slice is a view of the file's mapping: copy out just the shard.
                        weights[name] = sl[index].to(torch.float32, copy=True).contiguous()
                        continue
                    tensor = f.get_tensor(stored)
                weights[name] = tensor.to(torch.float32).contiguous()
    return weights, shapes


def load_safetensors_float32(
    model_dir: str, rename: Callable[[str], str | None], *, select: TensorSelector | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's ``*.safetensors`` files as contiguous float32, under the name
    ``rename`` gives it (None: skipped). A name found twice is a ValueError; no file at all is a
    FileNotFoundError.

    With ``select``, only the part of each tensor it selects is read from disk (see
    :data:`TensorSelector`; the renamed name is passed to it); a tensor it skips is left out.
    """
    return _read_safetensors(model_dir, rename, select)[0]


def meta_tensors(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Data-less (``meta`` device) tensors of the given full shapes, for :meth:`ModelConfig.check_weights`
    when only slices of the weights were loaded."""
    return {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}


def load_hf_weights(
    model_dir: str, config: ModelConfig, *, select: TensorSelector | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's ``*.safetensors`` files, as float32, checked against ``config``.

    When the embeddings are tied, a stored ``lm_head.weight`` is dropped; when the checkpoint has no
    ``lm_head.weight`` at all, ``config.tie_word_embeddings`` is set (the model cannot be untied).

    With ``select`` (a :data:`TensorSelector`), only the selected slice of each tensor is read and
    tensors it skips are left out; the names and full shapes of all the files' tensors are still
    checked against ``config`` (and decide the tying), so a mismatched checkpoint gives the same
    error. Sharded loading does not split MoE checkpoints' fused experts by slice: a fused tensor
    must be selected whole (or skipped with its pair).
    """
    weights, shapes = _read_safetensors(
        model_dir, lambda name: None if name.endswith(_IGNORED_SUFFIXES) else name, select
    )
    if "lm_head.weight" not in shapes:
        config.tie_word_embeddings = True
    elif config.tie_word_embeddings:
        del shapes["lm_head.weight"]
        weights.pop("lm_head.weight", None)
    if select is None:
        config.check_weights(weights, model_dir)
        return weights
    config.check_weights(meta_tensors(shapes), model_dir)
    if config.moe is not None:
        config.moe.split_fused_experts(config.num_hidden_layers, weights)
    return weights


def load_hf(
    model_dir: str, *, select: TensorSelector | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and float32 weights of a Hugging Face model directory (only the slices ``select``
    chooses, see :func:`load_hf_weights`)."""
    config = load_hf_config(model_dir)
    return config, load_hf_weights(model_dir, config, select=select)
