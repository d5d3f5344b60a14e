"""Tiny random-weight Hugging Face checkpoints for tests.

``make_tiny_hf_model`` writes a 2-layer, 64-wide model of one of the families in ``_CONFIG_CLASSES``
(Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2/3, Mixtral, Qwen2-MoE, Qwen3-MoE) made with
transformers (``config.json``, ``model.safetensors``, ``generation_config.json``) plus the default
model's tokenizer (vocabulary 49152, with its chat template) into a directory, ready for
``load_checkpoint`` and for ``AutoModelForCausalLM.from_pretrained`` as the reference.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from pagedllm.model.loader import default_model_path
from pagedllm.model.tokenizer import load_gguf_tokenizer

TINY_VOCAB_SIZE = 49152  # the default model's vocabulary, so its tokenizer fits

_CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mixtral": MixtralConfig,
    "qwen2_moe": Qwen2MoeConfig,
    "qwen3_moe": Qwen3MoeConfig,
    "phi3": Phi3Config,
    "gemma2": Gemma2Config,
    "gemma3_text": Gemma3TextConfig,
}


@functools.cache
def default_tokenizer() -> PreTrainedTokenizerBase:
    """The default model's tokenizer (loaded once per process, from the tokenizer cache)."""
    return load_gguf_tokenizer(default_model_path())


def tiny_hf_config(arch: str, tie_word_embeddings: bool = False, **overrides: Any) -> PretrainedConfig:
    """A transformers config for a tiny model of ``arch`` ("llama", "mistral", "qwen2", "qwen3")."""
    if arch not in _CONFIG_CLASSES:
        raise ValueError(f"Unknown tiny model architecture {arch!r}; choose from {sorted(_CONFIG_CLASSES)}.")
    kwargs: dict[str, Any] = {
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    if arch == "qwen3":
        kwargs["head_dim"] = 32  # deliberately not hidden_size // num_attention_heads
    if arch == "mistral":
        kwargs["sliding_window"] = None
    if arch == "mixtral":  # 4 experts of width 64 (intermediate_size), 2 per token
        kwargs.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=None)
    if arch in ("qwen2_moe", "qwen3_moe"):  # 8 experts of width 32, 2 per token
        kwargs.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    if arch == "qwen2_moe":
        kwargs["shared_expert_intermediate_size"] = 48
    if arch in ("gemma2", "gemma3_text"):
        kwargs["head_dim"] = 16  # transformers' Gemma default (256) would dwarf the tiny model
        kwargs["query_pre_attn_scalar"] = 24  # deliberately not head_dim
    kwargs.update(overrides)
    return _CONFIG_CLASSES[arch](**kwargs)


def make_tiny_hf_model(
    tmp_dir: str | os.PathLike[str],
    arch: str,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    **config_overrides: Any,
) -> str:
    """Create a tiny random-weight model of ``arch`` with the default tokenizer; return its directory.

    The model is written to ``tmp_dir/<arch>[-tied]`` in float32 safetensors. Norm weights and
    biases (which transformers initialises to ones / zeros) get random perturbations so that they
    matter. ``config_overrides`` are passed to the transformers config (e.g. ``initializer_range=0.2``
    for sharper logits).
    """
    config = tiny_hf_config(arch, tie_word_embeddings, **config_overrides)
    out = os.path.join(os.fspath(tmp_dir), arch + ("-tied" if tie_word_embeddings else ""))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(out)
    default_tokenizer().save_pretrained(out)
    return out
