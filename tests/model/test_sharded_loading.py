"""Sharded checkpoint loading: a ``select`` callback keeps only a slice of each tensor (GGUF blocks,
GGUF floats, safetensors) and the result equals the same slice of the whole load."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.gguf_writer import write_tiny_gguf
from helpers.model_factory import make_tiny_hf_model
from pagedllm.kernels.cpu.quant import QuantizedWeight, dequantize, row_bytes
from pagedllm.model.gguf_loader import load_gguf
from pagedllm.model.hf_loader import load_hf, load_safetensors_float32
from pagedllm.model.loader import TensorSelector, default_model_path, load_checkpoint

torch.set_num_threads(1)

Weights = dict[str, torch.Tensor | QuantizedWeight]


def _default_selector(name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
    """Rows 64..192 of q_proj (heads 1-2), one KV head of k_proj, block-aligned columns of o_proj and
    down_proj, a block of both of gate_proj, rows 10..20 of the embedding; layer 5 skipped."""
    if name.startswith("model.layers.5."):
        return None
    if name.endswith("self_attn.q_proj.weight"):
        return (slice(64, 192),)
    if name.endswith("self_attn.k_proj.weight"):
        return (slice(64, 128),)
    if name.endswith("self_attn.o_proj.weight"):
        return (slice(None), slice(0, 192))
    if name.endswith("mlp.down_proj.weight"):
        return (slice(None), slice(512, 1024))
    if name.endswith("mlp.gate_proj.weight"):
        return (slice(256, 512), slice(32, 96))
    if name == "model.embed_tokens.weight":
        return (slice(10, 20),)
    if name == "model.norm.weight":
        return (slice(0, 100),)
    return ()


@functools.cache
def _default_full(keep_quantized: bool) -> Weights:
    return load_gguf(default_model_path(), keep_quantized=keep_quantized)[1]


def _expected_blocks(full: QuantizedWeight, index: tuple[slice, ...]) -> torch.Tensor:
    """The bytes of ``full``'s blocks that hold the values ``index`` selects."""
    rows = index[0] if index else slice(None)
    c0, c1, _ = (index[1] if len(index) > 1 else slice(None)).indices(full.in_features)
    return full.blocks[rows, row_bytes(full.type_name, c0) : row_bytes(full.type_name, c1)]


def _assert_shard_of(full: Weights, shard: Weights, select: TensorSelector) -> None:
    """``shard`` holds exactly ``full[name][select(name, shape)]`` for every tensor not skipped."""
    kept = set()
    for name, value in full.items():
        index = select(name, tuple(value.shape))
        if index is None:
            assert name not in shard, name
            continue
        kept.add(name)
        got = shard[name]
        if isinstance(value, QuantizedWeight):
            assert isinstance(got, QuantizedWeight) and got.type_name == value.type_name, name
            assert torch.equal(got.blocks, _expected_blocks(value, index)), name
            assert torch.equal(dequantize(got), dequantize(value)[index]), name
            assert got.shape == tuple(dequantize(value)[index].shape), name
        else:
            assert isinstance(got, torch.Tensor), name
            assert got.dtype == torch.float32 and got.is_contiguous(), name
            assert torch.equal(got, value[index]), name
            if index:  # only the shard is kept, not a view of the whole tensor
                assert got.untyped_storage().nbytes() == got.numel() * 4, name
    assert set(shard) == kept


@pytest.mark.parametrize("keep_quantized", [True, False], ids=["blocks", "float"])
def test_default_gguf_shard_equals_slices_of_the_full_load(keep_quantized: bool) -> None:
    calls: dict[str, tuple[int, ...]] = {}

    def select(name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        calls[name] = shape
        return _default_selector(name, shape)

    config, shard = load_gguf(default_model_path(), keep_quantized=keep_quantized, select=select)
    full = _default_full(keep_quantized)
    # Called once per tensor, with HF names and full HF shapes.
    assert calls == {name: tuple(value.shape) for name, value in full.items()}
    assert calls["model.layers.3.self_attn.q_proj.weight"] == (576, 576)
    assert calls["model.layers.3.self_attn.k_proj.weight"] == (192, 576)
    assert calls["model.layers.3.mlp.down_proj.weight"] == (576, 1536)
    assert calls["model.embed_tokens.weight"] == (49152, 576)
    assert config.num_hidden_layers == 30 and config.head_dim == 64
    assert not any(name.startswith("model.layers.5.") for name in shard)
    assert "model.layers.4.self_attn.q_proj.weight" in shard
    q = shard["model.layers.0.self_attn.q_proj.weight"]
    assert tuple(q.shape) == (128, 576)
    if keep_quantized:
        assert isinstance(q, QuantizedWeight) and q.type_name == "Q4_1"
        embed = shard["model.embed_tokens.weight"]
        assert isinstance(embed, QuantizedWeight) and embed.blocks.shape[0] == 10
    _assert_shard_of(full, shard, _default_selector)


def test_unaligned_quantized_columns_name_the_tensor() -> None:
    def select(name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        if name == "model.layers.2.self_attn.o_proj.weight":
            return (slice(None), slice(0, 100))
        return None

    with pytest.raises(
        ValueError, match=r"model\.layers\.2\.self_attn\.o_proj\.weight.*32.*quantization=\"none\""
    ):
        load_gguf(default_model_path(), keep_quantized=True, select=select)
    # As float32 any column range loads.
    _, floats = load_gguf(default_model_path(), keep_quantized=False, select=select)
    assert list(floats) == ["model.layers.2.self_attn.o_proj.weight"]
    full = _default_full(False)["model.layers.2.self_attn.o_proj.weight"]
    assert isinstance(full, torch.Tensor)
    assert torch.equal(floats["model.layers.2.self_attn.o_proj.weight"], full[:, :100])


@pytest.mark.parametrize("keep_quantized", [True, False], ids=["blocks", "float"])
def test_rotary_rows_must_be_whole_heads(keep_quantized: bool) -> None:
    def select(name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        return (slice(32, 96),) if name == "model.layers.0.self_attn.q_proj.weight" else None

    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight.*whole heads of 64"):
        load_gguf(default_model_path(), keep_quantized=keep_quantized, select=select)


def test_bad_selection_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="step-1 slices"):
        load_gguf(default_model_path(), select=lambda name, shape: (slice(0, 10, 2),))
    with pytest.raises(ValueError, match="at most 1 slices"):
        load_gguf(
            default_model_path(), select=lambda name, shape: (slice(None),) * 2 if len(shape) == 1 else None
        )


# ---------------------------------------------------------------------------------------------
# A tiny GGUF of mixed types: K blocks (256 values), Q5_0 (repacked as Q8_0), Q5_1 (dequantized), F16


_MIXED_TYPES = {
    "self_attn.q_proj.weight": "Q4_K",
    "self_attn.k_proj.weight": "Q5_0",
    "self_attn.o_proj.weight": "Q8_0",
    "mlp.gate_proj.weight": "Q4_0",
    "mlp.up_proj.weight": "Q5_1",
    "mlp.down_proj.weight": "Q6_K",
}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("mixed")
    cfg, weights = load_hf(
        make_tiny_hf_model(
            tmp, "llama", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2
        )
    )
    types = {name: t for name in weights for suffix, t in _MIXED_TYPES.items() if name.endswith(suffix)}
    path = str(tmp / "tiny-mixed.gguf")
    write_tiny_gguf(path, "llama", cfg, weights, types=types)
    return path


def _mixed_selector(name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
    if name.endswith("self_attn.q_proj.weight"):
        return (slice(64, 192), slice(0, 256))  # heads 1-2, all columns
    if name.endswith("self_attn.k_proj.weight"):
        return (slice(64, 128), slice(32, 96))
    if name.endswith("self_attn.o_proj.weight"):
        return (slice(None), slice(0, 64))
    if name.endswith("mlp.gate_proj.weight"):
        return (slice(128, 512),)
    if name.endswith("mlp.up_proj.weight"):
        return (slice(None), slice(96, 224))  # Q5_1 is dequantized: any range
    if name.endswith("mlp.down_proj.weight"):
        return (slice(100, 200), slice(256, 512))
    if name == "model.embed_tokens.weight":
        return (slice(10, 20), slice(3, 7))  # F16: any range
    if name == "lm_head.weight":
        return None
    return ()


@pytest.mark.parametrize("keep_quantized", [True, False], ids=["blocks", "float"])
def test_mixed_types_shard_equals_slices_of_the_full_load(mixed_gguf: str, keep_quantized: bool) -> None:
    _, full = load_gguf(mixed_gguf, keep_quantized=keep_quantized)
    config, shard = load_gguf(mixed_gguf, keep_quantized=keep_quantized, select=_mixed_selector)
    assert not config.tie_word_embeddings  # from the file's names, though lm_head was skipped
    _assert_shard_of(full, shard, _mixed_selector)
    if keep_quantized:
        k = shard["model.layers.1.self_attn.k_proj.weight"]
        assert isinstance(k, QuantizedWeight) and k.type_name == "Q8_0" and k.shape == (64, 64)
        down = shard["model.layers.0.mlp.down_proj.weight"]
        assert isinstance(down, QuantizedWeight) and down.type_name == "Q6_K" and down.shape == (100, 256)


def test_unaligned_k_block_columns_are_refused(mixed_gguf: str) -> None:
    def select(name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        return (slice(None), slice(0, 128)) if name.endswith("mlp.down_proj.weight") else ()

    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*256"):
        load_gguf(mixed_gguf, keep_quantized=True, select=select)


# ---------------------------------------------------------------------------------------------
# Hugging Face safetensors


def _hf_selector(name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
    if name.startswith("model.layers.1."):
        return None
    if name.endswith(("q_proj.weight", "gate_proj.weight")):
        return (slice(16, 48),)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return (slice(None), slice(16, 40))
    if name == "model.embed_tokens.weight":
        return (slice(10, 20), slice(0, 32))
    if name == "lm_head.weight":
        return None
    return ()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_hf_model(tmp_path_factory.mktemp("hf"), "llama")


def test_safetensors_shard_equals_slices_of_the_full_load(tiny_llama: str) -> None:
    full_config, full = load_hf(tiny_llama)
    config, shard = load_hf(tiny_llama, select=_hf_selector)
    # lm_head is in the file: still untied, though the selector skipped it.
    assert not config.tie_word_embeddings and config == full_config
    _assert_shard_of(dict(full), dict(shard), _hf_selector)
    assert "lm_head.weight" not in shard and "model.layers.0.input_layernorm.weight" in shard
    assert tuple(shard["model.layers.0.self_attn.o_proj.weight"].shape) == (64, 24)


def test_safetensors_bf16_shard(tiny_llama: str, tmp_path: Path) -> None:
    out = tmp_path / "bf16"
    out.mkdir()
    for file in os.listdir(tiny_llama):
        if not file.endswith(".safetensors"):
            os.symlink(os.path.join(tiny_llama, file), out / file)
    tensors = load_file(os.path.join(tiny_llama, "model.safetensors"))
    save_file({n: t.to(torch.bfloat16) for n, t in tensors.items()}, str(out / "model.safetensors"))
    _, full = load_hf(str(out))
    _, shard = load_hf(str(out), select=_hf_selector)
    _assert_shard_of(dict(full), dict(shard), _hf_selector)


def test_load_safetensors_float32_select_gets_renamed_names(tiny_llama: str) -> None:
    seen: list[str] = []

    def select(name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        seen.append(name)
        return (slice(0, 2),) if name == "renamed.embed" else None

    weights = load_safetensors_float32(
        tiny_llama, lambda n: "renamed.embed" if n == "model.embed_tokens.weight" else n, select=select
    )
    assert "renamed.embed" in seen and "model.embed_tokens.weight" not in seen
    assert list(weights) == ["renamed.embed"] and tuple(weights["renamed.embed"].shape) == (2, 64)


def test_tied_checkpoint_ties_with_a_selector(tmp_path: Path) -> None:
    model_dir = make_tiny_hf_model(tmp_path, "llama", tie_word_embeddings=True)
    config, shard = load_hf(model_dir, select=lambda name, shape: None)
    assert config.tie_word_embeddings and shard == {}
    config, shard = load_hf(model_dir, select=lambda name, shape: ())
    _, full = load_hf(model_dir)
    assert "lm_head.weight" not in shard and set(shard) == set(full)


def test_wrong_shape_gives_the_same_error_with_a_selector(tiny_llama: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    for file in os.listdir(tiny_llama):
        if not file.endswith(".safetensors"):
            os.symlink(os.path.join(tiny_llama, file), bad / file)
    tensors = load_file(os.path.join(tiny_llama, "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(100, 64)
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"wrong shapes \[model.layers.1.mlp.up_proj.weight") as plain:
        load_hf(str(bad))
    # The selector skips both bad tensors (layer 1, and everything but the embedding): same error.
    for select in (_hf_selector, lambda name, shape: () if name == "model.embed_tokens.weight" else None):
        with pytest.raises(ValueError) as sharded:
            load_hf(str(bad), select=select)
        assert str(sharded.value) == str(plain.value)
    assert "missing tensors [model.layers.0.self_attn.k_proj.weight]" in str(plain.value)


def test_load_checkpoint_passes_the_selector(tiny_llama: str) -> None:
    ckpt = load_checkpoint(tiny_llama, select=_hf_selector)
    _, shard = load_hf(tiny_llama, select=_hf_selector)
    assert set(ckpt.weights) == set(shard)
    for name, value in shard.items():
        got = ckpt.weights[name]
        assert isinstance(got, torch.Tensor) and torch.equal(got, value), name

    def embed_rows(name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        return (slice(10, 20),) if name == "model.embed_tokens.weight" else None

    ckpt = load_checkpoint(None, keep_quantized=True, select=embed_rows)
    assert list(ckpt.weights) == ["model.embed_tokens.weight"]
    embed = ckpt.weights["model.embed_tokens.weight"]
    full = _default_full(True)["model.embed_tokens.weight"]
    assert isinstance(embed, QuantizedWeight) and isinstance(full, QuantizedWeight)
    assert embed.shape == (10, 576) and torch.equal(embed.blocks, full.blocks[10:20])
    assert ckpt.config.eos_token_ids  # the rest of the checkpoint loads as usual


def test_moe_checkpoint_selected_whole_matches_the_full_load(tmp_path: Path) -> None:
    model_dir = make_tiny_hf_model(tmp_path, "qwen3_moe")
    _, full = load_hf(model_dir)
    _, shard = load_hf(model_dir, select=lambda name, shape: ())
    assert set(shard) == set(full)
    assert all(torch.equal(shard[n], full[n]) for n in full)


def test_gguf_float_shard_owns_only_its_rows() -> None:
    """Row-sliced float tensors are dequantized from the selected rows only (no full-size buffer)."""
    _, shard = load_gguf(
        default_model_path(),
        select=lambda name, shape: (slice(10, 20),) if name == "model.embed_tokens.weight" else None,
    )
    embed = shard["model.embed_tokens.weight"]
    assert isinstance(embed, torch.Tensor)
    assert embed.untyped_storage().nbytes() == 10 * 576 * 4
