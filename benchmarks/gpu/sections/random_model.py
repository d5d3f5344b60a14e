"""``random_model`` (and ``equivalence_model``): a Qwen3 checkpoint with random weights, written by
transformers from a config into a directory, with a tokenizer (the default model's when installed,
else a word-level one over the whole vocabulary: the workloads are token ids)."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import Any

import torch

from pagedllm_bench.baselines import hf_dtype
from pagedllm_bench.common import free_device_memory

from .common import ModelShape

logger = logging.getLogger("run_gpu")


def trivial_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer over ``<t0> ... <t{vocab_size-1}>`` (the benchmark feeds token ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<t0>", bos_token="<t1>", eos_token="<t2>", pad_token="<t0>"
    )


def write_random_model(
    shape: ModelShape,
    out_dir: str,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    initializer_range: float = 0.02,
) -> dict[str, Any]:
    """Write a Qwen3 checkpoint with random weights (normal, std ``initializer_range``) and a
    tokenizer into ``out_dir``."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from pagedllm.model.loader import default_model_path

    t0 = time.perf_counter()
    # transformers 5 folds rope_theta into rope_parameters; older versions take it as is.
    rope: dict[str, Any] = {"rope_theta": shape.rope_theta}
    config = Qwen3Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-6,
        initializer_range=initializer_range,
        tie_word_embeddings=True,
        bos_token_id=151643,  # Qwen3's <|endoftext|>
        eos_token_id=151645,  # Qwen3's <|im_end|>
        **rope,
    )
    torch.manual_seed(seed)
    model: Any
    try:
        with torch.device(device):  # initialising on the GPU is much faster
            model = AutoModelForCausalLM.from_config(config, **hf_dtype(dtype))
    except Exception as exc:  # pragma: no cover - depends on the transformers version
        logger.info("Initialising on %s failed (%s); initialising on the CPU.", device, exc)
        model = AutoModelForCausalLM.from_config(config, **hf_dtype(dtype))
    model.save_pretrained(out_dir)
    num_params = sum(p.numel() for p in model.parameters())
    del model
    free_device_memory(device)
    tokenizer_source = "trivial"
    try:
        from pagedllm.model.tokenizer import load_gguf_tokenizer

        load_gguf_tokenizer(default_model_path()).save_pretrained(out_dir)
        tokenizer_source = "default model"
    except Exception as exc:  # the default model package is optional here
        logger.info("Default model tokenizer unavailable (%s); writing a trivial tokenizer.", exc)
        trivial_tokenizer(shape.vocab_size).save_pretrained(out_dir)
    return {
        "path": out_dir,
        "initializer_range": initializer_range,
        "num_params": num_params,
        "tokenizer": tokenizer_source,
        "seconds": time.perf_counter() - t0,
        **asdict(shape),
    }
