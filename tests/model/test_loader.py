"""Checkpoint loading: GGUF and Hugging Face directories, configs, tokenizers and their cache."""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from helpers.gguf_writer import write_tiny_gguf
from helpers.model_factory import default_tokenizer, make_tiny_hf_model
from pagedllm.model import tokenizer as tokenizer_mod
from pagedllm.model.config import ModelConfig
from pagedllm.model.gguf_loader import gguf_display_name, llama3_rope_freq_factors, load_gguf
from pagedllm.model.hf_loader import load_hf
from pagedllm.model.loader import LoadedCheckpoint, default_model_path, load_checkpoint, resolve_model_path
from pagedllm.model.tokenizer import gguf_tokenizer_cache_dir, load_gguf_tokenizer

torch.set_num_threads(1)

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café — 日本語のテキスト, emoji 🎉🚀, Ελληνικά, русский",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces,\ttabs\n\nand newlines  ",
    "<|endoftext|>def f(x):\n    return x ** 2<|endoftext|>",
    "",
]


@pytest.fixture(scope="module")
def default_ckpt() -> LoadedCheckpoint:
    return load_checkpoint(None)


# ---------------------------------------------------------------------------------------------
# The default GGUF model


def test_default_model_path_is_the_packaged_gguf() -> None:
    path = default_model_path()
    assert os.path.isfile(path)
    assert os.path.basename(path) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_model_path(None) == ("gguf", path)


def test_default_model_config(default_ckpt: LoadedCheckpoint) -> None:
    cfg = default_ckpt.config
    assert default_ckpt.name == "SmolLM2-135M-Instruct"
    assert default_ckpt.path == default_model_path()
    assert cfg.architecture == "llama" and cfg.vocab_size == 49152
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (576, 1536, 30)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.rms_norm_eps == 1e-5 and cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert cfg.max_position_embeddings == 8192
    assert cfg.tie_word_embeddings and not cfg.attention_bias and not cfg.qk_norm
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == [2]
    assert default_ckpt.tokenizer.eos_token_id == 2
    assert default_ckpt.tokenizer.chat_template and "<|im_start|>" in default_ckpt.tokenizer.chat_template
    assert "lm_head.weight" not in default_ckpt.weights
    assert all(w.dtype == torch.float32 for w in default_ckpt.weights.values())


def test_default_gguf_weights_match_transformers(
    default_ckpt: LoadedCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    # transformers rebuilds the same (pure) llama.cpp name table once per submodule; memoise it.
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
    cfg = default_ckpt.config
    hf_config = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)  # only used for the name mapping
    ref = load_gguf_checkpoint(default_ckpt.path, return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = default_ckpt.weights
    assert set(ours) == set(ref)
    for name, tensor in ref.items():
        assert ours[name].shape == tensor.shape, name
        assert torch.allclose(ours[name], tensor.float(), rtol=0, atol=1e-6), name


# ---------------------------------------------------------------------------------------------
# Tokenizers


def test_gguf_tokenizer_matches_transformers_and_is_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    path = default_model_path()
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    conversions: list[str] = []

    def convert(p: str) -> object:
        conversions.append(p)
        return ref

    monkeypatch.setattr(tokenizer_mod, "convert_gguf_tokenizer", convert)
    entry = gguf_tokenizer_cache_dir(path)
    assert entry.is_relative_to(tmp_path / "tokenizers")
    assert not entry.exists()

    first = load_gguf_tokenizer(path)
    assert conversions == [path] and first is ref
    assert entry.is_dir()
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # no temp dirs left behind

    cached = load_gguf_tokenizer(path)
    assert conversions == [path], "second load must come from the cache"
    assert cached is not ref
    for text in TEXTS:
        assert cached(text)["input_ids"] == ref(text)["input_ids"], text
        ids = ref(text)["input_ids"]
        assert cached.decode(ids) == ref.decode(ids)
    assert cached.chat_template == ref.chat_template
    assert (cached.eos_token_id, cached.bos_token_id, cached.pad_token_id) == (
        ref.eos_token_id,
        ref.bos_token_id,
        ref.pad_token_id,
    )
    messages = [{"role": "user", "content": "Hi there"}]
    assert cached.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    assert len(cached) == len(ref)


def test_tokenizer_cache_keeps_existing_entry_and_rebuilds_corrupt_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = default_tokenizer()
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    path = default_model_path()
    monkeypatch.setattr(tokenizer_mod, "convert_gguf_tokenizer", lambda p: tok)
    entry = gguf_tokenizer_cache_dir(path)

    # A corrupt entry (complete marker, broken tokenizer.json) is replaced by a fresh conversion.
    entry.mkdir(parents=True)
    (entry / tokenizer_mod._COMPLETE_MARKER).write_text("{}")
    (entry / "tokenizer_config.json").write_text("{}")
    (entry / "tokenizer.json").write_text("not json")
    assert load_gguf_tokenizer(path) is tok
    reloaded = load_gguf_tokenizer(path)
    assert reloaded is not tok and reloaded("héllo")["input_ids"] == tok("héllo")["input_ids"]

    # Another process publishing the same entry first: the existing one is kept, nothing leaks.
    before = sorted(p.name for p in entry.iterdir())
    tokenizer_mod._store_cached(entry, tok, path, replace=False)
    assert sorted(p.name for p in entry.iterdir()) == before
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]


# ---------------------------------------------------------------------------------------------
# Hugging Face directories


@pytest.mark.parametrize(
    ("arch", "tied"),
    [("qwen2", False), ("qwen3", False), ("qwen3", True), ("llama", False), ("mistral", True)],
)
def test_tiny_hf_model_loads_identical_tensors(tmp_path: Path, arch: str, tied: bool) -> None:
    model_dir = make_tiny_hf_model(tmp_path, arch, tie_word_embeddings=tied)
    ckpt = load_checkpoint(model_dir)
    ref = load_file(os.path.join(model_dir, "model.safetensors"))
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir)
    state = hf_model.state_dict()
    if tied:
        state.pop("lm_head.weight")
    assert set(ckpt.weights) == set(state) == set(ref) - ({"lm_head.weight"} if tied else set())
    for name, tensor in state.items():
        assert torch.equal(ckpt.weights[name], tensor), name

    cfg, hf_cfg = ckpt.config, hf_model.config
    assert cfg.architecture == ("llama" if arch == "mistral" else arch)
    assert cfg.tie_word_embeddings == tied
    assert cfg.attention_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
    assert cfg.head_dim == hf_model.model.layers[0].self_attn.head_dim
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 128, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.vocab_size == hf_cfg.vocab_size == len(ckpt.tokenizer)
    assert cfg.rms_norm_eps == hf_cfg.rms_norm_eps and cfg.rope_theta == 10000.0
    assert cfg.max_position_embeddings == 512 and cfg.eos_token_ids == [2] and cfg.bos_token_id == 1
    assert ckpt.name == os.path.basename(model_dir) and ckpt.path == model_dir
    assert ckpt.tokenizer.chat_template == default_tokenizer().chat_template


def test_eos_ids_prefer_generation_config_then_config_then_tokenizer(tmp_path: Path) -> None:
    model_dir = make_tiny_hf_model(tmp_path, "qwen2")
    with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 0]}, f)
    assert load_checkpoint(model_dir).config.eos_token_ids == [2, 0]

    os.remove(os.path.join(model_dir, "generation_config.json"))
    config_path = os.path.join(model_dir, "config.json")
    with open(config_path) as f:
        hf = json.load(f)
    hf["eos_token_id"] = 0
    with open(config_path, "w") as f:
        json.dump(hf, f)
    assert load_checkpoint(model_dir).config.eos_token_ids == [0]

    hf["eos_token_id"] = None
    with open(config_path, "w") as f:
        json.dump(hf, f)
    assert load_checkpoint(model_dir).config.eos_token_ids == [default_tokenizer().eos_token_id]


def test_bfloat16_checkpoint_is_upcast(tmp_path: Path) -> None:
    model_dir = make_tiny_hf_model(tmp_path, "qwen3")
    ref = load_file(os.path.join(model_dir, "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in ref.items()}, os.path.join(model_dir, "model.safetensors"))
    config, weights = load_hf(model_dir)
    for name, tensor in ref.items():
        assert weights[name].dtype == torch.float32
        assert torch.equal(weights[name], tensor.to(torch.bfloat16).float()), name


# ---------------------------------------------------------------------------------------------
# Configs


def _hf_dict(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    base.update(overrides)
    return base


def test_rope_settings_legacy_and_transformers5() -> None:
    llama3 = {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
    }
    legacy = ModelConfig.from_hf_config(
        _hf_dict(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **llama3}, eos_token_id=[7, 9])
    )
    v5 = ModelConfig.from_hf_config(
        _hf_dict(
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **llama3}, eos_token_id=[7, 9]
        )
    )
    assert legacy == v5
    assert v5.rope_theta == 500000.0 and v5.rope_scaling == {"rope_type": "llama3", **llama3}
    assert v5.eos_token_ids == [7, 9] and v5.head_dim == 16

    plain = ModelConfig.from_hf_config(_hf_dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None
    linear = ModelConfig.from_hf_config(_hf_dict(rope_scaling={"type": "linear", "factor": 2.0}))
    assert linear.rope_theta == 10000.0 and linear.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    qwen3 = ModelConfig.from_hf_config(_hf_dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3"))
    assert qwen3.head_dim == 128 and qwen3.qk_norm and not qwen3.attention_bias  # transformers' default
    mistral = ModelConfig.from_hf_config(
        _hf_dict(
            architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=4096, head_dim=None
        )
    )
    assert mistral.architecture == "llama" and mistral.sliding_window == 4096 and mistral.head_dim == 16


def test_unsupported_configs_are_rejected() -> None:
    with pytest.raises(ValueError, match="Unsupported model architecture 'GPT2LMHeadModel'"):
        ModelConfig.from_hf_config(_hf_dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf_config(_hf_dict(hidden_act="gelu"))
    with pytest.raises(ValueError, match="attention_bias"):
        ModelConfig.from_hf_config(_hf_dict(attention_bias=True))
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig.from_hf_config(_hf_dict(num_key_value_heads=3))


# ---------------------------------------------------------------------------------------------
# Errors and path resolution


def test_unknown_architecture_in_config_json(tmp_path: Path) -> None:
    with open(tmp_path / "config.json", "w") as f:
        json.dump(_hf_dict(architectures=["FancyNewForCausalLM"], model_type="fancy"), f)
    with pytest.raises(ValueError, match="FancyNewForCausalLM"):
        load_checkpoint(str(tmp_path))


def test_bad_paths_give_clear_errors(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_checkpoint(missing)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="notes.txt"):
        load_checkpoint(str(tmp_path / "notes.txt"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="neither a config.json nor a .gguf"):
        load_checkpoint(str(empty))
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    with open(no_weights / "config.json", "w") as f:
        json.dump(_hf_dict(), f)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_checkpoint(str(no_weights))


def test_missing_tensor_is_reported(tmp_path: Path) -> None:
    model_dir = make_tiny_hf_model(tmp_path, "qwen2")
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"missing tensors \[model.layers.1.self_attn.k_proj.bias\]"):
        load_hf(model_dir)


def test_directory_with_gguf_files(tmp_path: Path) -> None:
    one = tmp_path / "one"
    one.mkdir()
    os.symlink(default_model_path(), one / "model.Q4_1.gguf")
    assert resolve_model_path(str(one)) == ("gguf", str(one / "model.Q4_1.gguf"))
    os.symlink(default_model_path(), one / "other.gguf")
    with pytest.raises(ValueError, match="several .gguf files"):
        resolve_model_path(str(one))


def test_gguf_display_names() -> None:
    assert gguf_display_name("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert gguf_display_name("Llama-3.2-1B-Instruct-Q4_K_M.gguf") == "Llama-3.2-1B-Instruct"
    assert gguf_display_name("qwen2.5-0.5b-instruct-fp16.gguf") == "qwen2.5-0.5b-instruct"
    assert gguf_display_name("model.gguf") == "model"


# ---------------------------------------------------------------------------------------------
# Tiny GGUF files written from tiny HF models (exercise qwen2 / qwen3 tensors and the llama row order)


@pytest.mark.parametrize(("arch", "tied"), [("qwen2", False), ("qwen3", True), ("llama", False)])
def test_tiny_gguf_round_trip(tmp_path: Path, arch: str, tied: bool) -> None:
    hf_cfg, hf_weights = load_hf(make_tiny_hf_model(tmp_path, arch, tie_word_embeddings=tied))
    path = str(tmp_path / f"tiny-{arch}.F16.gguf")
    rope_freqs = None
    if arch == "llama":
        hf_cfg.rope_theta = 500000.0
        hf_cfg.rope_scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        rope_freqs = llama3_rope_freq_factors(hf_cfg.rope_scaling, hf_cfg.rope_theta, hf_cfg.head_dim)
    expected = write_tiny_gguf(path, arch, hf_cfg, hf_weights, rope_freqs)

    cfg, weights = load_gguf(path)
    assert set(weights) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name
    hf_cfg.eos_token_ids = [2, 5]
    assert cfg == hf_cfg

    ckpt_dir = tmp_path / "gguf-dir"
    ckpt_dir.mkdir()
    shutil.copy(path, ckpt_dir)
    assert resolve_model_path(str(ckpt_dir)) == ("gguf", str(ckpt_dir / os.path.basename(path)))


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = str(tmp_path / "gpt2.gguf")
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="Unsupported model architecture 'gpt2"):
        load_gguf(path)


def test_gguf_with_expert_tensors_is_refused_by_name(tmp_path: Path) -> None:
    """A Mixtral-style GGUF (experts stacked in ``ffn_*_exps`` tensors) is a clear error, not an
    "unexpected tensor" deep in loading."""
    path = tmp_path / "moe.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((2, 4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"mixture-of-experts tensors \('blk.0.ffn_gate_exps.weight'\)"):
        load_gguf(str(path))
