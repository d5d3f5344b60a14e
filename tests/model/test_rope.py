"""RoPE scaling tables (:mod:`pagedllm.model.rope`, :class:`pagedllm.model.layers.RotaryEmbedding`)
against transformers' rope init functions for every rope type, the config values transformers
derives (``original_max_position_embeddings``, ``factor``, Phi-3's legacy types), GGUF YaRN metadata,
and the errors for what the engine does not implement."""

from __future__ import annotations

from typing import Any

import gguf
import pytest
import torch
from transformers import LlamaConfig, Phi3Config, PretrainedConfig, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedllm.model.config import ModelConfig
from pagedllm.model.gguf_loader import gguf_config
from pagedllm.model.layers import RotaryEmbedding
from pagedllm.model.rope import ROPE_TYPES, rope_frequencies, validate_rope_scaling

TINY = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
HEAD_DIM = 16
SHORT = [1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0]
LONG = [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0]


def _model_config(hf: PretrainedConfig, arch: str) -> ModelConfig:
    d = hf.to_dict()
    d["architectures"] = [arch]
    return ModelConfig.from_hf_config(d)


def _hf_tables(hf: PretrainedConfig, positions: int, seq_len: int | None = None) -> tuple[torch.Tensor, ...]:
    """cos and sin as transformers' rotary embedding computes them (float32), ``[positions, D / 2]``."""
    rope_type = hf.rope_parameters["rope_type"]
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](hf, None, seq_len=seq_len)
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq.float())
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


def _assert_tables_equal(
    hf: PretrainedConfig, arch: str, positions: int, seq_len: int | None = None
) -> RotaryEmbedding:
    cfg = _model_config(hf, arch)
    rope = RotaryEmbedding(cfg.head_dim, positions, cfg.rope_theta, cfg.rope_scaling)
    cos, sin = _hf_tables(hf, positions, seq_len)
    # transformers rounds angles to float32 (error ~ position * 6e-8); the engine computes in float64.
    torch.testing.assert_close(rope.cos_cache, cos, rtol=0, atol=5e-5)
    torch.testing.assert_close(rope.sin_cache, sin, rtol=0, atol=5e-5)
    return rope


YARN_CASES: dict[str, dict[str, Any]] = {
    "plain": {"factor": 4.0},
    "betas-untruncated": {"factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
    "attention-factor": {"factor": 4.0, "attention_factor": 0.9},
    "mscale-pair": {"factor": 16.0, "mscale": 0.707, "mscale_all_dim": 1.0},
    "mscale-alone-unused": {"factor": 4.0, "mscale": 2.0},  # transformers needs both to use them
    "zero-betas-mean-defaults": {"factor": 4.0, "beta_fast": 0, "beta_slow": 0},
}


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_tables_match_transformers(case: str) -> None:
    scaling = {"rope_type": "yarn", "original_max_position_embeddings": 32, **YARN_CASES[case]}
    rope = _assert_tables_equal(LlamaConfig(**TINY, rope_scaling=scaling), "LlamaForCausalLM", 512)
    if case == "plain":
        assert rope.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1.0)
        # The factor multiplies the tables: their rows are no longer unit vectors.
        norm = rope.cos_cache**2 + rope.sin_cache**2
        torch.testing.assert_close(norm, torch.full_like(norm, rope.attention_factor**2))


def test_yarn_qwen2_legacy_type_key() -> None:
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    _assert_tables_equal(Qwen2Config(**TINY, rope_scaling=scaling), "Qwen2ForCausalLM", 300)


def test_yarn_missing_factor_is_the_context_ratio() -> None:
    """transformers derives a missing YaRN factor as max_position_embeddings / original length."""
    cfg = ModelConfig.from_hf_config(
        {
            **TINY,
            "architectures": ["LlamaForCausalLM"],
            "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 64},
        }
    )
    assert cfg.rope_scaling == {"rope_type": "yarn", "original_max_position_embeddings": 64, "factor": 8.0}


def test_llama3_linear_and_dynamic_tables_match_transformers() -> None:
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    _assert_tables_equal(LlamaConfig(**TINY, rope_scaling=llama3), "LlamaForCausalLM", 512)
    linear = {"rope_type": "linear", "factor": 2.5}
    _assert_tables_equal(LlamaConfig(**TINY, rope_scaling=linear), "LlamaForCausalLM", 512)
    # Dynamic NTK within max_position_embeddings is plain RoPE, in transformers and here; past it
    # the base is stretched for the table's length (transformers: for the current length).
    dynamic = {"rope_type": "dynamic", "factor": 4.0}
    hf = LlamaConfig(**TINY, rope_scaling=dynamic)
    _assert_tables_equal(hf, "LlamaForCausalLM", 512)
    cfg = _model_config(hf, "LlamaForCausalLM")
    assert cfg.rope_scaling == {
        "rope_type": "dynamic",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
    }
    stretched = RotaryEmbedding(cfg.head_dim, 1024, cfg.rope_theta, cfg.rope_scaling)
    cos, _ = _hf_tables(hf, 1024, seq_len=1024)
    torch.testing.assert_close(stretched.cos_cache, cos, rtol=0, atol=1e-4)


def _phi3(**extra: Any) -> Phi3Config:
    scaling = {"type": "longrope", "short_factor": SHORT, "long_factor": LONG}
    return Phi3Config(**TINY, original_max_position_embeddings=32, rope_scaling=scaling, **extra)


def test_longrope_tables_short_within_and_long_past_the_original_length() -> None:
    """The table length decides: up to the original length the short factors (transformers' choice
    for every sequence that short), past it the long factors at every position (transformers' choice
    once the sequence is longer)."""
    hf = _phi3()
    cfg = _model_config(hf, "Phi3ForCausalLM")
    assert cfg.architecture == "phi3"
    assert cfg.rope_scaling is not None and cfg.rope_scaling["factor"] == 512 / 32  # the context ratio
    short = _assert_tables_equal(hf, "Phi3ForCausalLM", 32, seq_len=None)
    long = _assert_tables_equal(hf, "Phi3ForCausalLM", 33, seq_len=33)
    assert short.attention_factor == long.attention_factor > 1.0
    assert not torch.allclose(short.cos_cache[5:], long.cos_cache[5:32])
    long_freqs = rope_frequencies(HEAD_DIM, 10000.0, cfg.rope_scaling, 512)
    short_freqs = rope_frequencies(HEAD_DIM, 10000.0, cfg.rope_scaling, 32)
    torch.testing.assert_close(
        short_freqs.inv_freq * torch.tensor(SHORT, dtype=torch.float64),
        long_freqs.inv_freq * torch.tensor(LONG, dtype=torch.float64),
    )


def test_longrope_attention_factor_and_explicit_factor() -> None:
    hf = _phi3()
    hf.rope_parameters["attention_factor"] = 1.25
    _assert_tables_equal(hf, "Phi3ForCausalLM", 64, seq_len=64)
    llama = LlamaConfig(
        **TINY,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": SHORT,
            "long_factor": LONG,
            "factor": 3.0,
            "original_max_position_embeddings": 32,
        },
    )
    _assert_tables_equal(llama, "LlamaForCausalLM", 100, seq_len=100)


def test_phi3_config_legacy_forms() -> None:
    """Phi-3's "su" (and "yarn") mean longrope; its top-level original length wins, 4096 by default."""
    base = {
        **TINY,
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "max_position_embeddings": 131072,
    }
    su = ModelConfig.from_hf_config(
        {
            **base,
            "original_max_position_embeddings": 4096,
            "rope_scaling": {"type": "su", "short_factor": SHORT, "long_factor": LONG},
        }
    )
    assert su.rope_scaling == {
        "rope_type": "longrope",
        "short_factor": SHORT,
        "long_factor": LONG,
        "original_max_position_embeddings": 4096,
        "factor": 32.0,
    }
    yarn = ModelConfig.from_hf_config(
        {
            **base,
            "rope_scaling": {
                "type": "yarn",
                "short_factor": SHORT,
                "long_factor": LONG,
                "original_max_position_embeddings": 77,
            },
        }
    )
    assert yarn.rope_scaling is not None and yarn.rope_scaling["rope_type"] == "longrope"
    assert yarn.rope_scaling["original_max_position_embeddings"] == 4096
    plain = ModelConfig.from_hf_config({**base, "sliding_window": 2047, "rope_scaling": None})
    assert plain.rope_scaling is None and plain.sliding_window == 2047 and plain.rms_norm_eps == 1e-5
    shapes = plain.weight_shapes()
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (64 + 2 * 32, 64)
    assert shapes["model.layers.1.mlp.gate_up_proj.weight"] == (256, 64)
    assert (
        "model.layers.0.self_attn.q_proj.weight" not in shapes
        and "model.layers.0.mlp.up_proj.weight" not in shapes
    )


def test_top_level_original_length_wins_as_in_transformers() -> None:
    cfg = ModelConfig.from_hf_config(
        {
            **TINY,
            "architectures": ["LlamaForCausalLM"],
            "original_max_position_embeddings": 64,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        }
    )
    assert cfg.rope_scaling is not None and cfg.rope_scaling["original_max_position_embeddings"] == 64


def test_unknown_rope_type_is_an_error_naming_it() -> None:
    hf = {
        **TINY,
        "architectures": ["LlamaForCausalLM"],
        "rope_scaling": {"rope_type": "mrope2", "factor": 2.0},
    }
    with pytest.raises(ValueError, match="Unsupported rope scaling type 'mrope2'"):
        ModelConfig.from_hf_config(hf)
    with pytest.raises(ValueError, match="'mrope2'"):
        RotaryEmbedding(HEAD_DIM, 64, 10000.0, {"rope_type": "mrope2", "factor": 2.0})
    assert set(ROPE_TYPES) == {"default", "linear", "dynamic", "llama3", "yarn", "longrope"}


@pytest.mark.parametrize(
    "scaling, match",
    [
        (
            {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "llama_4_scaling_beta": 0.1,
            },
            "does not use \\['llama_4_scaling_beta'\\]",
        ),
        (
            {"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0},
            "does not use \\['low_freq_factor'\\]",
        ),
        (
            {
                "rope_type": "longrope",
                "short_factor": SHORT,
                "long_factor": LONG,
                "factor": 2.0,
                "original_max_position_embeddings": 32,
                "short_mscale": 1.2,
            },
            "short_mscale",
        ),
        (
            {
                "rope_type": "longrope",
                "short_factor": SHORT[:4],
                "long_factor": LONG,
                "factor": 2.0,
                "original_max_position_embeddings": 32,
            },
            "short_factor has 4 entries",
        ),
        ({"rope_type": "yarn", "factor": 4.0}, "needs \\['original_max_position_embeddings'\\]"),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ],
)
def test_parameters_a_scheme_does_not_use_are_refused(scaling: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_rope_scaling(scaling, HEAD_DIM)


def test_partial_rotary_factor_is_refused_in_configs() -> None:
    base = {**TINY, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3"}
    with pytest.raises(ValueError, match="partial_rotary_factor 0.75"):
        ModelConfig.from_hf_config({**base, "partial_rotary_factor": 0.75})
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5"):
        ModelConfig.from_hf_config(
            {
                **base,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
            }
        )
    ok = ModelConfig.from_hf_config(
        {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}}
    )
    assert ok.rope_scaling is None


def _gguf_with_rope(tmp_path: Any, name: str, **rope: Any) -> ModelConfig:
    path = str(tmp_path / f"{name}.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(2)
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_vocab_size(100)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(4.0)
    for name, value in rope.items():
        getattr(w, f"add_rope_scaling_{name}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf_config(gguf.GGUFReader(path))


def test_gguf_yarn_metadata(tmp_path) -> None:
    cfg = _gguf_with_rope(
        tmp_path, "full", orig_ctx_len=32, yarn_beta_fast=16.0, yarn_beta_slow=2.0, yarn_attn_factor=0.9
    )
    assert cfg.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
        "attention_factor": 0.9,
    }
    hf = LlamaConfig(**TINY, rope_scaling=dict(cfg.rope_scaling))
    _assert_tables_equal(hf, "LlamaForCausalLM", 512)
    bare = _gguf_with_rope(tmp_path, "bare")
    assert bare.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    with pytest.raises(ValueError, match="yarn_log_multiplier"):
        _gguf_with_rope(tmp_path, "log", orig_ctx_len=32, yarn_log_mul=0.1)


def test_scaled_context_length() -> None:
    def cfg(max_pos: int, scaling: dict[str, Any] | None) -> ModelConfig:
        return ModelConfig.from_hf_config(
            {
                **TINY,
                "architectures": ["Qwen2ForCausalLM"],
                "max_position_embeddings": max_pos,
                "rope_scaling": scaling,
            }
        )

    # Qwen2.5's recipe: the original length stays as max_position_embeddings, YaRN stretches it 4x.
    yarn = cfg(32768, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    assert yarn.scaled_context_length() == 131072
    assert cfg(512, {"type": "linear", "factor": 2.0}).scaled_context_length() == 1024
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}
    assert cfg(512, llama3).scaled_context_length() == 512
    assert cfg(512, None).scaled_context_length() == 512
    # Dynamic NTK would need each sequence's own base: the engine keeps it within the trained length.
    assert cfg(512, {"rope_type": "dynamic", "factor": 4.0}).scaled_context_length() == 512
