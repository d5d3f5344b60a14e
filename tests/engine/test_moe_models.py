"""Mixtral, Qwen2-MoE (shared expert, a dense layer) and Qwen3-MoE (top-k renormalised or not) tiny
random models against HF transformers: greedy tokens and top-5 logprobs by the near-tie rule, with
prefix caching, chunked prefill and forced preemption, on the torch and cpu attention backends with
the experts on the native CPU kernel and on the torch fallback, and on the Triton attention backend
through the interpreter: with the experts on the CPU kernel (as the model runs them on CPU tensors),
and with them sent, for the test, to the Triton fused-MoE kernel (which the model uses on a GPU)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from helpers.model_factory import make_tiny_hf_model
from helpers.reference import assert_greedy_close, hf_greedy
from pagedllm import LLM, SamplingParams
from pagedllm.kernels.cpu import moe as cpu_moe
from pagedllm.model import moe as moe_module
from pagedllm.model.config import ModelConfig
from pagedllm.model.cpu_decode import unsupported_reason
from pagedllm.model.hf_loader import load_hf

# Two prompts share a 16-token prefix (two blocks of 8), so the second run hits the prefix cache.
SHARED = "Once upon a time, in a land far away, there lived a king and"
PROMPTS = [SHARED + " and then", "The tiny model says", SHARED + " counting on"]
MAX_TOKENS = 10

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {"mlp_only_layers": [1]}),
    "qwen3_moe-norm": ("qwen3_moe", {"norm_topk_prob": True}),
    "qwen3_moe": ("qwen3_moe", {"norm_topk_prob": False}),
    # decoder_sparse_step 2: layer 0 dense, layer 1 sparse.
    "qwen3_moe-step2": ("qwen3_moe", {"norm_topk_prob": True, "decoder_sparse_step": 2}),
}


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``name -> (path, {prompt: (hf tokens, hf top-5)})``, each model made once."""
    cache: dict[str, tuple[str, dict[str, Any]]] = {}

    def get(name: str) -> tuple[str, dict[str, Any]]:
        if name not in cache:
            arch, overrides = MODELS[name]
            path = make_tiny_hf_model(tmp_path_factory.mktemp(name), arch, initializer_range=0.2, **overrides)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            cache[name] = (path, {"hf": hf})
        return cache[name]

    return get


def _reference(entry: tuple[str, dict[str, Any]], ids: list[int]) -> tuple[list[int], list[dict[int, float]]]:
    refs = entry[1]
    key = tuple(ids)
    if key not in refs:
        refs[key] = hf_greedy(refs["hf"], ids, MAX_TOKENS)
    return refs[key]


def _check_against_hf(llm: LLM, entry: tuple[str, dict[str, Any]], label: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    for run in range(2):  # the second run reads the shared prefix from the cache
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        for prompt, out in zip(PROMPTS, outs, strict=True):
            hf_tokens, hf_top = _reference(entry, out.prompt_token_ids)
            o = out.outputs[0]
            assert_greedy_close(o.token_ids, o.logprobs, hf_tokens, hf_top, f"{label} run {run} {prompt!r}")
            for t, lp in hf_top[0].items():
                assert abs(o.logprobs[0][t].logprob - lp) < 1e-3
        if run == 1:
            assert sum(out.num_cached_tokens for out in outs) > 0
    llm.llm_engine.check_idle()


def _small_engine(path: str, backend: str) -> LLM:
    """Chunked prefill (a 16-token budget) and a pool of 6 blocks of 8 for 3 requests of up to 28
    tokens, which forces preemption."""
    return LLM(
        path,
        attention_backend=backend,
        num_kv_blocks=6,
        block_size=8,
        max_num_batched_tokens=16,
        max_model_len=64,
        enable_prefix_caching=True,
    )


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_moe_matches_hf_native_experts(
    tiny_moe: Any, monkeypatch: pytest.MonkeyPatch, name: str, backend: str
) -> None:
    if not cpu_moe.usable(torch.zeros(1)):
        pytest.skip("native CPU kernels unavailable")
    calls = []
    native = cpu_moe.moe_experts_packed

    def counting(*args: Any) -> torch.Tensor:
        calls.append(1)
        return native(*args)

    monkeypatch.setattr(cpu_moe, "moe_experts_packed", counting)
    entry = tiny_moe(name)
    llm = _small_engine(entry[0], backend)
    _check_against_hf(llm, entry, f"{name} {backend}")
    assert calls, "the experts did not run on the native kernel"
    assert llm.llm_engine.get_stats().num_preemptions > 0


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_matches_hf_torch_fallback(tiny_moe: Any, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setattr(cpu_moe, "usable", lambda *tensors: False)
    calls = []
    fallback = moe_module.experts_torch

    def counting(*args: Any) -> torch.Tensor:
        calls.append(1)
        return fallback(*args)

    monkeypatch.setattr(moe_module, "experts_torch", counting)
    entry = tiny_moe(name)
    llm = _small_engine(entry[0], "cpu")
    _check_against_hf(llm, entry, f"{name} torch fallback")
    assert calls, "the experts did not run on the torch fallback"
    assert llm.llm_engine.get_stats().num_preemptions > 0


def test_moe_triton_attention_backend(tiny_moe: Any) -> None:
    """Triton attention (interpreted on CPU tensors): two prompts, four tokens (the interpreter is
    slow); the experts run on the CPU kernel."""
    pytest.importorskip("triton")
    entry = tiny_moe("qwen2_moe")
    llm = LLM(entry[0], attention_backend="triton", num_kv_blocks=32, block_size=8, max_model_len=64)
    assert llm.llm_engine.runner.backend.name == "triton"
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True)
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS[:2], outs, strict=True):
        hf_tokens, hf_top = _reference(entry, out.prompt_token_ids)
        o = out.outputs[0]
        assert_greedy_close(o.token_ids, o.logprobs, hf_tokens[:4], hf_top[:4], f"triton {prompt!r}")
    llm.llm_engine.check_idle()


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe-step2"])
def test_moe_experts_on_triton_kernel_in_the_engine(
    tiny_moe: Any, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The engine on the Triton attention backend with the experts routed, for this test, to the
    Triton fused-MoE kernel (interpreted on CPU tensors; the model sends them there only on a GPU):
    chunked prefill, a decode batch and the HF reference."""
    pytest.importorskip("triton")
    from pagedllm.kernels.triton import fused_moe

    calls = []

    def triton_experts(*args: Any) -> torch.Tensor:
        calls.append(1)
        return fused_moe.fused_experts(*args)

    monkeypatch.setattr(cpu_moe, "usable", lambda *tensors: False)
    monkeypatch.setattr(moe_module, "experts_torch", triton_experts)
    entry = tiny_moe(name)
    llm = LLM(
        entry[0], attention_backend="triton", num_kv_blocks=32, block_size=8, max_model_len=64,
        max_num_batched_tokens=16,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        hf_tokens, hf_top = _reference(entry, out.prompt_token_ids)
        o = out.outputs[0]
        assert_greedy_close(o.token_ids, o.logprobs, hf_tokens[:4], hf_top[:4], f"{name} triton {prompt!r}")
        for t, lp in hf_top[0].items():
            assert abs(o.logprobs[0][t].logprob - lp) < 1e-3
    assert calls
    llm.llm_engine.check_idle()


def test_fused_expert_checkpoint_loads_the_same(tiny_moe: Any, tmp_path: Any) -> None:
    """transformers 5's fused layout (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj``
    [E, H, I]) loads to the same weights as the per-expert layout, for Mixtral's names too."""
    for name in ("mixtral", "qwen2_moe"):
        path = tiny_moe(name)[0]
        config, weights = load_hf(path)
        assert config.moe is not None
        stored = load_file(os.path.join(path, "model.safetensors"))
        block = "block_sparse_moe" if name == "mixtral" else "mlp"
        g, u, d = ("w1", "w3", "w2") if name == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        fused = {}
        for key, tensor in stored.items():
            if f"{block}.experts." not in key:
                fused[key.replace(f".{block}.gate.", ".mlp.gate.")] = tensor
        for i in range(config.num_hidden_layers):
            if not config.moe.is_sparse_layer(i):
                continue
            p = f"model.layers.{i}.{block}.experts."
            experts = range(config.moe.num_experts)
            fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([stored[f"{p}{e}.{g}.weight"], stored[f"{p}{e}.{u}.weight"]]) for e in experts]
            )
            fused[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack(
                [stored[f"{p}{e}.{d}.weight"] for e in experts]
            )
        out = tmp_path / name
        out.mkdir()
        for file in os.listdir(path):
            if not file.endswith(".safetensors"):
                (out / file).write_bytes(open(os.path.join(path, file), "rb").read())
        save_file(fused, str(out / "model.safetensors"))
        _, fused_weights = load_hf(str(out))
        assert fused_weights.keys() == weights.keys()
        for key, tensor in weights.items():
            assert torch.equal(fused_weights[key], tensor), key
        stacked = moe_module.stack_expert_weights(config, fused_weights)
        gate_up = fused["model.layers.0.mlp.experts.gate_up_proj"]
        assert torch.equal(stacked["model.layers.0.mlp.experts.gate_up_proj"], gate_up)


def test_moe_refuses_weight_quantization_and_native_decode(tiny_moe: Any) -> None:
    path = tiny_moe("qwen3_moe")[0]
    with pytest.raises(ValueError, match="mixture-of-experts"):
        LLM(path, quantization="int8", num_kv_blocks=16)
    llm = LLM(path, num_kv_blocks=16, block_size=8, max_model_len=64)
    runner = llm.llm_engine.runner
    assert unsupported_reason(runner.model, "cpu") == "mixture-of-experts layers"
    assert runner.native_decode is None
    llm.llm_engine.check_idle()


def _hf_dict(arch: str, **overrides: Any) -> dict[str, Any]:
    from helpers.model_factory import tiny_hf_config

    return tiny_hf_config(arch, **overrides).to_dict()


def test_moe_config_fields_from_hf() -> None:
    mixtral = ModelConfig.from_hf_config(_hf_dict("mixtral"))
    assert mixtral.architecture == "mixtral" and mixtral.moe is not None
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.moe.intermediate_size) == (4, 2, 64)
    assert mixtral.moe.norm_topk_prob and mixtral.moe.checkpoint_block == "block_sparse_moe"
    assert not mixtral.attention_bias and not mixtral.qk_norm

    qwen2 = ModelConfig.from_hf_config(_hf_dict("qwen2_moe", mlp_only_layers=[0], decoder_sparse_step=1))
    assert qwen2.moe is not None and qwen2.attention_bias  # qkv_bias defaults to true
    assert qwen2.moe.shared_expert_intermediate_size == 48 and not qwen2.moe.norm_topk_prob
    assert [qwen2.moe.is_sparse_layer(i) for i in range(2)] == [False, True]
    assert not ModelConfig.from_hf_config(_hf_dict("qwen2_moe", qkv_bias=False)).attention_bias

    qwen3 = ModelConfig.from_hf_config(_hf_dict("qwen3_moe", decoder_sparse_step=2, norm_topk_prob=True))
    assert qwen3.qk_norm and qwen3.moe is not None and qwen3.moe.norm_topk_prob
    assert (qwen3.moe.num_experts, qwen3.moe.intermediate_size) == (8, 32)
    assert [qwen3.moe.is_sparse_layer(i) for i in range(2)] == [False, True]
    shapes = qwen3.weight_shapes()
    assert "model.layers.0.mlp.gate_proj.weight" in shapes  # the dense layer
    assert shapes["model.layers.1.mlp.experts.7.down_proj.weight"] == (64, 32)
    assert ModelConfig.from_hf_config(_hf_dict("qwen3_moe", num_experts=0)).moe is None


def test_moe_config_refusals() -> None:
    with pytest.raises(ValueError, match="attention_bias"):
        ModelConfig.from_hf_config({**_hf_dict("mixtral"), "attention_bias": True})
    with pytest.raises(ValueError, match="exceeds num_experts"):
        ModelConfig.from_hf_config(_hf_dict("qwen3_moe", num_experts_per_tok=9))
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf_config(_hf_dict("mixtral", hidden_act="gelu"))
