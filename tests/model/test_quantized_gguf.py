"""GGUF files run on their own blocks (``quantization="auto"``): what is kept quantized and how, the
logged fallback for types without kernels, one copy of each weight, the native decode layers over
mixed-type projections, and the errors of impossible combinations."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.gguf_writer import write_tiny_gguf
from helpers.model_factory import make_tiny_hf_model
from helpers.native_decode import CheckedNativeDecode
from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.kernels.cpu.library import kernels_available
from pagedllm.kernels.cpu.linear import PanelLinear
from pagedllm.kernels.cpu.quant import QuantizedWeight, amx_available, dequantize
from pagedllm.kernels.cpu.quant_linear import QuantEmbedding, QuantLinear
from pagedllm.model.gguf_loader import load_gguf, unpermute_rotary_rows
from pagedllm.model.hf_loader import load_hf
from pagedllm.model.loader import default_model_path

needs_kernels = pytest.mark.skipif(not kernels_available(), reason="no C compiler for the CPU kernels")

# Every supported type, mixed inside the fused projections, plus Q5_1 (no kernels: dequantized).
TYPES = {
    "self_attn.q_proj.weight": "Q4_K",
    "self_attn.k_proj.weight": "Q6_K",
    "self_attn.v_proj.weight": "Q8_0",
    "self_attn.o_proj.weight": "Q5_K",
    "mlp.gate_proj.weight": "Q4_0",
    "mlp.up_proj.weight": "Q4_1",
    "mlp.down_proj.weight": "Q5_1",
}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    """A 2-layer llama (hidden 256, so that K blocks fit) written with the types above, the token
    embedding Q8_0 and tied to the LM head; returns its path and the float values it holds."""
    tmp = tmp_path_factory.mktemp("mixed")
    cfg, weights = load_hf(
        make_tiny_hf_model(
            tmp,
            "llama",
            tie_word_embeddings=True,
            hidden_size=256,
            intermediate_size=512,
            num_attention_heads=4,
            num_key_value_heads=2,
            initializer_range=0.05,
        )
    )
    types = {name: t for name in weights for suffix, t in TYPES.items() if name.endswith(suffix)}
    types["model.embed_tokens.weight"] = "Q8_0"
    path = str(tmp / "tiny-mixed.gguf")
    return path, write_tiny_gguf(path, "llama", cfg, weights, types=types)


def test_blocks_are_kept_and_equal_the_float_load(
    mixed_gguf: tuple[str, dict[str, torch.Tensor]], caplog: pytest.LogCaptureFixture
) -> None:
    path, expected = mixed_gguf
    with caplog.at_level(logging.WARNING, logger="pagedllm.model.gguf_loader"):
        kept_config, kept = load_gguf(path, keep_quantized=True)
    assert "Q5_1 (2 tensors)" in caplog.text  # the fallback, logged once with its types
    float_config, floats = load_gguf(path)
    # Blocks keep the file's q/k row order (views, no copy); the float load undoes it.
    assert kept_config.rope_interleaved and not float_config.rope_interleaved
    for name, value in kept.items():
        if isinstance(value, QuantizedWeight):
            got = dequantize(value)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = got.shape[0] // kept_config.head_dim
                got = torch.from_numpy(unpermute_rotary_rows(got.numpy(), heads))
            assert torch.equal(got, floats[name]), name
        else:
            assert torch.equal(value, floats[name]), name
        assert torch.equal(floats[name], expected[name]), name
    kinds = {n.split(".", 3)[-1]: w.type_name for n, w in kept.items() if isinstance(w, QuantizedWeight)}
    assert kinds["self_attn.q_proj.weight"] == "Q4_K" and kinds["mlp.gate_proj.weight"] == "Q4_0"
    assert not isinstance(kept["model.layers.0.mlp.down_proj.weight"], QuantizedWeight)


def _quantized_layers(llm: Any) -> dict[str, str]:
    model = llm.llm_engine.runner.model
    return {name: type(module).__name__ for name, module in model.named_modules() if name.count(".") <= 3}


@needs_kernels
def test_engine_runs_the_blocks_and_native_decode_matches(
    make_llm: Any, mixed_gguf: tuple[str, dict[str, torch.Tensor]]
) -> None:
    path, _ = mixed_gguf
    llm = make_llm(path, tokenizer=default_model_path(), num_kv_blocks=64, max_model_len=512)
    model = llm.llm_engine.runner.model
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert isinstance(attn.qkv_proj, QuantLinear) and [p.type_name for p in attn.qkv_proj.parts] == [
        "Q4_K",
        "Q6_K",
        "Q8_0",
    ]
    assert [p.type_name for p in mlp.gate_up_proj.parts] == ["Q4_0", "Q4_1"]
    assert isinstance(mlp.down_proj, PanelLinear)  # Q5_1: dequantized, then panels
    assert isinstance(model.embed_tokens, QuantEmbedding) and isinstance(model.lm_head, QuantLinear)
    assert model.lm_head.parts[0].blocks is model.embed_tokens.table.blocks  # tied: one copy

    runner = llm.llm_engine.runner
    checked = CheckedNativeDecode(runner)
    runner.native_decode = checked
    try:
        prompts = [[1, 500, 600, 700], [1, 42] * 9, [1, 7]]
        params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(3)]
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.native_decode = checked.native
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 7, 10]
    assert set(checked.batch_sizes) == {1, 2, 3}
    # Alone or in a batch, the same tokens (every product is row-independent).
    alone = llm.generate([prompts[1]], params[1], use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outs[1].outputs[0].token_ids
    llm.llm_engine.check_idle()


@needs_kernels
@pytest.mark.skipif(not kernels_available() or not amx_available(), reason="no AMX-BF16 here")
def test_native_decode_rows_take_the_integer_kernels_at_every_batch_size(
    make_llm: Any, mixed_gguf: tuple[str, dict[str, torch.Tensor]]
) -> None:
    """With the AMX tiles on (the default), decode steps of 20 sequences down to 1: the native layers
    run decode rows on the integer kernels as the Python forward does (their hidden states match at
    every batch size), however many rows the step has."""
    path, _ = mixed_gguf
    llm = make_llm(path, tokenizer=default_model_path(), num_kv_blocks=64, max_model_len=512)
    runner = llm.llm_engine.runner
    checked = CheckedNativeDecode(runner)
    runner.native_decode = checked
    try:
        prompts = [[1, 100 + i, 200 + 3 * i] for i in range(20)]
        params = [SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True) for i in range(20)]
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.native_decode = checked.native
    assert set(checked.batch_sizes) == set(range(1, 21))
    llm.llm_engine.check_idle()


def test_default_model_layers_by_quantization(default_llm: Any, float_llm: Any) -> None:
    model = default_llm.llm_engine.runner.model
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.embed_tokens.table.type_name == "Q8_0"
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 4 * 30 + 1  # every projection and the tied LM head
    assert {p.type_name for m in linears[:-1] for p in m.parts} == {"Q4_1"}
    weight_bytes = sum(m.nbytes for m in linears[:-1]) + model.embed_tokens.table.nbytes
    weight_bytes += sum(p.numel() * 4 for p in model.parameters())  # the norms
    # One copy of each weight, at its stored size: within 2 % of the file.
    assert weight_bytes <= 1.02 * os.path.getsize(default_model_path())
    assert not any(isinstance(m, QuantLinear) for m in float_llm.llm_engine.runner.model.modules())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"quantization": "int4"}, "quantization must be one of auto, none, int8, fp8"),
        ({"quantization": "int8"}, r"quantization='int8' quantizes a float checkpoint.*Q4_1"),
        ({"quantization": "fp8"}, r"quantization='fp8' quantizes a float checkpoint"),
        ({"dtype": "bfloat16"}, r"dtype='bfloat16' is not possible with it.*quantization='none'"),
    ],
)
def test_impossible_combinations_name_the_field(make_llm: Any, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_llm(**kwargs)


def test_fp8_needs_a_gpu(make_llm: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="quantization='fp8' needs a CUDA GPU"):
        make_llm(
            make_tiny_hf_model(tmp_path, "llama"), quantization="fp8", num_kv_blocks=16, max_model_len=512
        )


def test_cli_flag() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--quantization", "none"])
    assert EngineConfig.from_cli_args(args).quantization == "none"
    assert EngineConfig.from_cli_args(parser.parse_args([])).quantization == "auto"


_RSS_SCRIPT = """
import json, logging, sys
import torch
import pagedllm.worker.executor  # everything the engine imports, before the first reading
from pagedllm import LLM, SamplingParams
from pagedllm.worker.cpu_memory import weight_memory

logging.basicConfig(level=logging.INFO)

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

before = rss()
llm = LLM(num_kv_blocks=64, max_model_len=512)
loaded = rss() - before
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # every weight read once
weights = weight_memory(llm.llm_engine.runner.model)
print(json.dumps({"loaded": loaded, "delta": rss() - before, "kv": llm.llm_engine.executor.kv_cache_bytes,
                  "mapped": weights.mapped, "copied": weights.copied}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_loading_raises_rss_by_about_the_file() -> None:
    """The default model's quantized weights are views of the GGUF file's memory map (the llama q/k
    projections, whose rows are reordered, the only copies), held once: at most 1.05x the file. In a
    fresh process, loading and one request (every weight read) raise the RSS by less than that,
    plus the KV cache, plus 160 MiB for what is not weights: the tokenizer and its vocabulary, the
    kernel library, the sampler's and step inputs' buffers (256 rows of a 49,152-token vocabulary
    alone are 48 MiB) and the allocator's slack. Before the weights are read, loading adds less than
    half the file. The start-up log says how the memory divides. Float32 weights would be 540 MiB."""
    import json
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    reading = json.loads(proc.stdout.strip().splitlines()[-1])
    size = os.path.getsize(default_model_path())
    assert reading["mapped"] + reading["copied"] <= 1.05 * size, reading
    assert reading["copied"] < 0.2 * size, reading
    assert reading["loaded"] < 0.5 * size + 160 * 2**20, reading
    assert reading["delta"] < 1.05 * size + reading["kv"] + 160 * 2**20, (reading, size)
    assert "CPU memory: weights" in proc.stderr and "mapped from the checkpoint file" in proc.stderr
