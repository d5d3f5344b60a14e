"""LoRA adapters in the engine, against PEFT running the same adapters on the same weights.

Adapters are made here with PEFT on the default model's HF form (random, non-zero A and B), each with
its own rank, targets and scaling. pagedllm's greedy tokens and top-5 logprobs must equal PEFT's by the
logprob-close rule, for each adapter alone and for a batch mixing three adapters with the base model;
the prefix cache must never serve one adapter's blocks to another; ``max_loras`` bounds the adapters
of a step without starving anyone; chunked prefill and preemption change nothing; bad adapters are
refused naming the field, changing nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.model_factory import default_tokenizer
from helpers.native_decode import CheckedNativeDecode
from helpers.prompts import REFERENCE_PROMPTS
from helpers.reference import assert_greedy_close, hf_greedy
from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.errors import RequestError
from pagedllm.model.loader import default_model_path

pytestmark = pytest.mark.slow

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (PEFT LoraConfig keywords)
ADAPTERS: dict[str, dict[str, Any]] = {
    "all8": {"r": 8, "lora_alpha": 16, "target_modules": ALL},
    "attn16": {
        "r": 16,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj", "o_proj"],
        "use_rslora": True,
    },
    "mlp4": {"r": 4, "lora_alpha": 12, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
}
IDS = {name: i + 1 for i, name in enumerate(ADAPTERS)}
MAX_TOKENS = 10
PROMPTS = REFERENCE_PROMPTS[:2]
ENGINE = {"quantization": "none", "num_kv_blocks": 256, "max_model_len": 1024}


@pytest.fixture(scope="module")
def peft_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Path]]:
    """A PEFT model holding every adapter of ``ADAPTERS``, and the folder each was saved to."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    torch.manual_seed(0)
    model = None
    folders = {}
    root = tmp_path_factory.mktemp("adapters")
    for name, kwargs in ADAPTERS.items():
        config = LoraConfig(init_lora_weights=False, **kwargs)
        if model is None:
            model = get_peft_model(hf, config, adapter_name=name)
        else:
            model.add_adapter(name, config)
        model.set_adapter(name)
        model.save_pretrained(str(root / name), selected_adapters=[name])
        saved = root / name if (root / name / "adapter_config.json").exists() else root / name / name
        folders[name] = saved
    assert model is not None
    return model.eval(), folders


def lora(name: str, folders: dict[str, Path]) -> LoRARequest:
    return LoRARequest(name, IDS[name], str(folders[name]))


@pytest.fixture(scope="module")
def reference(
    peft_model: tuple[Any, dict[str, Path]],
) -> dict[tuple[str, int], tuple[list[int], list[dict[int, float]]]]:
    """PEFT's greedy tokens and top-5 logprobs, per (adapter or "base", prompt index)."""
    model, _ = peft_model
    tok = default_tokenizer()
    out = {}
    for p, prompt in enumerate(PROMPTS):
        ids = tok.encode(prompt)
        for name in ADAPTERS:
            model.set_adapter(name)
            out[(name, p)] = hf_greedy(model, ids, MAX_TOKENS)
        with model.disable_adapter():
            out[("base", p)] = hf_greedy(model, ids, MAX_TOKENS)
    return out


@pytest.fixture(scope="module")
def llm() -> Any:
    return LLM(None, enable_lora=True, max_loras=4, max_lora_rank=16, **ENGINE)


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=5, ignore_eos=True)


def _check(outputs: list[Any], cases: list[tuple[str, int]], reference: dict[Any, Any]) -> None:
    for out, (name, p) in zip(outputs, cases, strict=True):
        completion = out.outputs[0]
        top = [{t: lp.logprob for t, lp in step.items()} for step in completion.logprobs]
        ref_tokens, ref_top = reference[(name, p)]
        assert_greedy_close(list(completion.token_ids), top, ref_tokens, ref_top, f"{name} prompt {p}")


def test_adapters_change_the_output(reference: dict[Any, Any]) -> None:
    """The test's adapters are not no-ops: each gives other tokens than the base model on a prompt."""
    for name in ADAPTERS:
        assert any(reference[(name, p)][0] != reference[("base", p)][0] for p in range(len(PROMPTS))), name


def test_each_adapter_alone_equals_peft(
    llm: Any, peft_model: tuple[Any, dict[str, Path]], reference: dict[Any, Any]
) -> None:
    _, folders = peft_model
    for name in ADAPTERS:
        cases = [(name, p) for p in range(len(PROMPTS))]
        outputs = llm.generate(PROMPTS, _params(), use_tqdm=False, lora_request=lora(name, folders))
        _check(outputs, cases, reference)
    llm.llm_engine.check_idle()


def test_adapters_over_the_gguf_blocks_equal_peft(
    peft_model: tuple[Any, dict[str, Path]], reference: dict[Any, Any]
) -> None:
    """The default model as users run it (GGUF blocks, q/k rows in llama.cpp's order): adapters on
    q/k/v/o and the MLP give PEFT's tokens by the logprob-close rule (PEFT runs the dequantized
    weights)."""
    _, folders = peft_model
    llm = LLM(None, enable_lora=True, max_loras=3, num_kv_blocks=256, max_model_len=1024)
    assert llm.llm_engine.model_config.rope_interleaved  # the rows stay in the file's order
    cases = [(name, p) for p in range(len(PROMPTS)) for name in ADAPTERS]
    loras = [lora(name, folders) for name, _ in cases]
    outputs = llm.generate([PROMPTS[p] for _, p in cases], _params(), use_tqdm=False, lora_request=loras)
    _check(outputs, cases, reference)
    llm.llm_engine.check_idle()


def test_a_mixed_batch_equals_peft_row_by_row(
    llm: Any, peft_model: tuple[Any, dict[str, Path]], reference: dict[Any, Any]
) -> None:
    """Three adapters and the base model in the same steps: each row as PEFT computes it alone."""
    _, folders = peft_model
    cases = [(name, p) for p in range(len(PROMPTS)) for name in [*ADAPTERS, "base"]]
    loras = [None if name == "base" else lora(name, folders) for name, _ in cases]
    prompts = [PROMPTS[p] for _, p in cases]
    outputs = llm.generate(prompts, _params(), use_tqdm=False, lora_request=loras)
    _check(outputs, cases, reference)
    llm.llm_engine.check_idle()


def test_native_decode_layers_add_the_adapters_as_the_python_forward(
    peft_model: tuple[Any, dict[str, Path]],
) -> None:
    """Decode steps with adapters run in the native layers over float panels; each such step is
    checked against the Python forward with the same adapters. Over GGUF blocks they are declined
    (decode steps then take the Python forward)."""
    _, folders = peft_model
    llm = LLM(None, enable_lora=True, max_loras=3, **ENGINE)
    runner = llm.llm_engine.executor.runner
    assert runner.native_decode is not None
    checked = CheckedNativeDecode(runner, tolerance=2e-4)
    runner.native_decode = checked
    names = [*ADAPTERS, "base"]
    loras = [None if name == "base" else lora(name, folders) for name in names] * 2
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
    llm.generate(prompts, _params(), use_tqdm=False, lora_request=loras)
    assert checked.batch_sizes and checked.lora_rows > 0
    llm.llm_engine.check_idle()
    quantized = LLM(None, enable_lora=True, num_kv_blocks=64, max_model_len=256)
    assert quantized.llm_engine.executor.runner.native_decode is None


def test_prefix_cache_is_keyed_by_adapter(llm: Any, peft_model: tuple[Any, dict[str, Path]]) -> None:
    """The same prompt under another adapter (or none) hits nothing; under the same adapter it hits."""
    _, folders = peft_model
    prompt = " ".join(f"Line {i} tells of the weather in town {i}." for i in range(12))
    params = SamplingParams(max_tokens=2, temperature=0)

    def cached(request: LoRARequest | None) -> int:
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=request)[0]
        return int(out.num_cached_tokens)

    llm.llm_engine.reset_prefix_cache()
    assert cached(lora("all8", folders)) == 0
    assert cached(lora("attn16", folders)) == 0
    assert cached(None) == 0
    assert cached(lora("all8", folders)) > 0
    assert cached(lora("attn16", folders)) > 0
    assert cached(None) > 0
    llm.llm_engine.check_idle()


def test_one_slot_runs_adapters_in_turn(
    peft_model: tuple[Any, dict[str, Path]], reference: dict[Any, Any]
) -> None:
    """``max_loras=1``: never two adapters running at once, every request finishes as PEFT says."""
    _, folders = peft_model
    llm = LLM(None, enable_lora=True, max_loras=1, **ENGINE)
    engine = llm.llm_engine
    cases = [(name, p) for p in range(len(PROMPTS)) for name in ADAPTERS]
    tok = default_tokenizer()
    for i, (name, p) in enumerate(cases):
        engine.add_request(str(i), tok.encode(PROMPTS[p]), _params(), lora_request=lora(name, folders))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[int(out.request_id)] = out
        adapters = {r.lora_int_id for r in engine.scheduler.running}
        assert len(adapters) <= 1, adapters
    _check([finished[i] for i in range(len(cases))], cases, reference)
    assert engine.executor.lora.slots.loads >= len(ADAPTERS)
    engine.check_idle()


def test_chunked_prefill_and_preemption_change_nothing(
    peft_model: tuple[Any, dict[str, Path]], reference: dict[Any, Any]
) -> None:
    """Prompts cut into 8-token chunks and a KV pool too small for every request at once (requests
    are preempted and recomputed): the same tokens as PEFT."""
    _, folders = peft_model
    llm = LLM(
        None,
        enable_lora=True,
        max_loras=3,
        quantization="none",
        max_model_len=128,
        num_kv_blocks=6,
        block_size=8,
        max_num_batched_tokens=8,
        preemption_mode="recompute",
    )
    cases = [(name, p) for p in range(len(PROMPTS)) for name in [*ADAPTERS, "base"]]
    loras = [None if name == "base" else lora(name, folders) for name, _ in cases]
    outputs = llm.generate([PROMPTS[p] for _, p in cases], _params(), use_tqdm=False, lora_request=loras)
    _check(outputs, cases, reference)
    assert llm.llm_engine.get_stats().num_preemptions > 0  # the pool was too small for all at once
    llm.llm_engine.check_idle()


def _write_adapter(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


def _pair(
    rank: int, out_f: int, in_f: int, layer: int = 0, proj: str = "self_attn.q_proj"
) -> dict[str, torch.Tensor]:
    key = f"base_model.model.model.layers.{layer}.{proj}"
    return {f"{key}.lora_A.weight": torch.randn(rank, in_f), f"{key}.lora_B.weight": torch.randn(out_f, rank)}


@pytest.mark.parametrize(
    ("config", "tensors", "words"),
    [
        (
            {"r": 32, "lora_alpha": 8, "target_modules": ["q_proj"]},
            _pair(32, 576, 576),
            "above max_lora_rank",
        ),
        (
            {"r": 8, "lora_alpha": 8, "target_modules": ["q_proj"], "use_dora": True},
            _pair(8, 576, 576),
            "use_dora",
        ),
        ({"r": 8, "lora_alpha": 8, "target_modules": ["embed_tokens"]}, _pair(8, 576, 576), "embed_tokens"),
        ({"r": 8, "lora_alpha": 8, "target_modules": ["q_proj"]}, _pair(8, 500, 576), "another base model"),
        ({"r": 8, "lora_alpha": 8, "target_modules": ["q_proj"]}, _pair(8, 576, 576, layer=99), "layer 99"),
        ({"r": 8, "lora_alpha": 8, "target_modules": ["q_proj"], "bias": "all"}, _pair(8, 576, 576), "bias"),
        ({"peft_type": "IA3", "target_modules": ["q_proj"]}, _pair(8, 576, 576), "peft_type"),
    ],
)
def test_bad_adapters_are_refused_naming_the_field(
    llm: Any, tmp_path: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], words: str
) -> None:
    path = _write_adapter(tmp_path / "bad", config, tensors)
    with pytest.raises(RequestError, match=words) as info:
        llm.generate(["Hi"], _params(), use_tqdm=False, lora_request=LoRARequest("bad", 90, path))
    assert info.value.param == "lora_path"
    llm.llm_engine.check_idle()
    assert llm.llm_engine.get_num_unfinished_requests() == 0


def test_other_refusals(llm: Any, peft_model: tuple[Any, dict[str, Path]], tmp_path: Path) -> None:
    _, folders = peft_model
    with pytest.raises(RequestError, match="neither a PEFT folder") as info:
        llm.generate(
            ["Hi"], _params(), use_tqdm=False, lora_request=LoRARequest("x", 91, str(tmp_path / "none"))
        )
    assert info.value.param == "lora_path"
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]})
    )
    (tmp_path / "bin" / "adapter_model.bin").write_bytes(b"not loaded")
    with pytest.raises(RequestError, match="adapter_model.bin"):
        llm.generate(
            ["Hi"], _params(), use_tqdm=False, lora_request=LoRARequest("x", 92, str(tmp_path / "bin"))
        )
    # One id names one adapter.
    llm.generate(["Hi"], _params(), use_tqdm=False, lora_request=lora("all8", folders))
    with pytest.raises(RequestError, match="already the adapter") as info:
        llm.generate(
            ["Hi"],
            _params(),
            use_tqdm=False,
            lora_request=LoRARequest("other", IDS["all8"], str(folders["mlp4"])),
        )
    assert info.value.param == "lora_request"
    with pytest.raises(RequestError, match="entries"):
        llm.generate(["Hi", "Ho"], _params(), use_tqdm=False, lora_request=[lora("all8", folders)])
    with pytest.raises(RequestError, match="lora_int_id"):
        LoRARequest("x", 0, "/tmp")
    llm.llm_engine.check_idle()


def test_lora_off_refuses_adapters_and_options_that_cannot_run(
    make_llm: Any, peft_model: tuple[Any, dict[str, Path]]
) -> None:
    _, folders = peft_model
    llm = make_llm(num_kv_blocks=64)
    with pytest.raises(RequestError, match="enable_lora") as info:
        llm.generate(["Hi"], _params(), use_tqdm=False, lora_request=lora("all8", folders))
    assert info.value.param == "lora_request"
    llm.llm_engine.check_idle()
    with pytest.raises(ValueError, match="speculative"):
        LLM(None, enable_lora=True, speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(None, enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(None, enable_lora=True, max_loras=2, max_cpu_loras=1)
