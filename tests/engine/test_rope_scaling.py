"""Long-context RoPE through the engine: Llama 3.1 ("llama3"), YaRN on Llama / Qwen2 / Qwen3 and
Phi-3 with LongRoPE, on tiny random checkpoints whose ``original_max_position_embeddings`` (32) the
prompts pass, so that the scaling changes every result. Greedy tokens and top-5 logprobs equal HF
transformers (fp32) by the near-tie rule, with chunked prefill, forced preemption and prefix-cache
hits, in the torch and cpu (native kernels and native decode) backends, and in Triton through the
interpreter."""

from __future__ import annotations

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from helpers.model_factory import default_tokenizer, make_tiny_hf_model  # noqa: E402
from helpers.native_decode import CheckedNativeDecode  # noqa: E402
from helpers.reference import assert_greedy_close, hf_greedy  # noqa: E402
from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.kernels.cpu.library import kernels_available  # noqa: E402

ORIGINAL = 32  # original_max_position_embeddings of every case: all prompts are longer
MAX_TOKENS = 8

PROMPTS = [
    "The numbers are 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14 and then",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
    "who repaired every clock in the whole valley. One winter morning",
    "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n\ndef sub(a, b):\n    return",
]

SHORT_PROMPTS = ["Hello there, how are you", "The tiny model says"]  # within ORIGINAL with the output

# Short and long LongRoPE factors of a head_dim 16 model (8 frequencies), deliberately different.
SHORT_FACTOR = [1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0]
LONG_FACTOR = [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0]

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": ORIGINAL,
            }
        },
    ),
    "llama-yarn": (
        "llama",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}},
    ),
    "qwen2-yarn": (
        "qwen2",
        {
            "rope_scaling": {
                "type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": ORIGINAL,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
                "truncate": False,
            }
        },
    ),
    "qwen3-yarn": (
        "qwen3",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": ORIGINAL,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
            }
        },
    ),
    "phi3-longrope": (
        "phi3",
        {
            "original_max_position_embeddings": ORIGINAL,
            "rope_scaling": {"type": "longrope", "short_factor": SHORT_FACTOR, "long_factor": LONG_FACTOR},
        },
    ),
}


def _triton_usable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# The Triton path runs in the interpreter on CPU (TRITON_INTERPRET=1, set above).
BACKENDS = ("torch", "cpu", "triton") if _triton_usable() else ("torch", "cpu")


def _make_model(tmp_path: Any, case: str, **extra: Any) -> str:
    arch, overrides = CASES[case]
    return make_tiny_hf_model(
        tmp_path / case, arch, initializer_range=0.2, max_position_embeddings=512, **overrides, **extra
    )


def _ids(prompts: list[str]) -> list[list[int]]:
    """Token ids, given to the engine and HF alike (a Qwen2 folder's own tokenizer class splits
    whitespace differently from the default model's)."""
    tok = default_tokenizer()
    return [tok(p).input_ids for p in prompts]


def _hf_reference(path: str, prompts: list[list[int]]) -> list[tuple[list[int], list[dict[int, float]]]]:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return [hf_greedy(hf, ids, MAX_TOKENS) for ids in prompts]


def _check(
    llm: LLM, prompts: list[list[int]], expected: list[Any], label: str, min_len: int = ORIGINAL + 1
) -> list[Any]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (out, (hf_tokens, hf_top)) in enumerate(zip(outs, expected, strict=True)):
        assert len(out.prompt_token_ids) >= min_len
        o = out.outputs[0]
        assert_greedy_close(o.token_ids, o.logprobs, hf_tokens, hf_top, f"{label} prompt {i}")
    return outs


@pytest.mark.parametrize("case", list(CASES))
def test_rope_scaling_matches_hf(tmp_path, case: str) -> None:
    """torch, cpu and triton backends, each with a 16-token budget (chunked prefill), a KV pool too small
    for all three requests (preemption) and a second round served from the prefix cache."""
    path = _make_model(tmp_path, case)
    prompts = _ids(PROMPTS)
    expected = _hf_reference(path, prompts)
    for backend in BACKENDS:
        llm = LLM(
            path,
            attention_backend=backend,
            block_size=8,
            num_kv_blocks=14,
            max_num_batched_tokens=16,
            max_model_len=128,
        )
        assert llm.llm_engine.runner.backend.name == backend
        label = f"{case} {backend}"
        _check(llm, prompts, expected, label)
        assert llm.llm_engine.get_stats().num_preemptions > 0, label
        again = _check(llm, prompts, expected, label + " (cached)")
        # The tiny pool evicts some cached blocks, but the second round starts from cached prefixes.
        assert sum(o.num_cached_tokens for o in again) >= 16, [o.num_cached_tokens for o in again]
        llm.llm_engine.check_idle()


@pytest.mark.skipif(not kernels_available(), reason="no C compiler for the CPU kernels")
def test_yarn_native_decode_matches_python_forward(tmp_path) -> None:
    """The native decode layers read the YaRN-scaled cos/sin tables: every decode step they run
    equals the Python forward, and the tokens equal HF."""
    path = _make_model(tmp_path, "llama-yarn")
    prompts = _ids(PROMPTS)
    expected = _hf_reference(path, prompts)
    llm = LLM(path, attention_backend="cpu", block_size=8, num_kv_blocks=64, max_model_len=128)
    runner = llm.llm_engine.runner
    assert runner.native_decode is not None
    assert runner.model.rotary.attention_factor > 1.0
    checked = CheckedNativeDecode(runner)
    runner.native_decode = checked
    try:
        _check(llm, prompts, expected, "llama-yarn native decode")
    finally:
        runner.native_decode = checked.native
    assert len(checked.batch_sizes) >= MAX_TOKENS - 1
    llm.llm_engine.check_idle()


def test_longrope_short_factors_within_original_length(tmp_path) -> None:
    """An engine whose max_model_len is within the original length uses the short factors, as
    transformers does for every sequence that short."""
    path = _make_model(tmp_path, "phi3-longrope")
    prompts = _ids(SHORT_PROMPTS)
    assert all(len(ids) + MAX_TOKENS <= ORIGINAL for ids in prompts)
    expected = _hf_reference(path, prompts)
    llm = LLM(path, attention_backend="torch", block_size=8, num_kv_blocks=32, max_model_len=ORIGINAL)
    _check(llm, prompts, expected, "longrope short", min_len=1)
    llm.llm_engine.check_idle()


def test_longrope_long_factors_for_every_position_past_original_length(tmp_path) -> None:
    """With max_model_len past the original length, every position is rotated with the long factors,
    short prompts included (a paged engine cannot switch factors mid-sequence): the reference is
    transformers with the long factors in place of the short ones; transformers with the real short
    factors differs."""
    path = _make_model(tmp_path, "phi3-longrope")
    long_only = _make_model(tmp_path / "long-only", "phi3-longrope")
    # The same weights (same seed) with short_factor := long_factor.
    cfg_path = os.path.join(long_only, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    rope = cfg.get("rope_parameters") or cfg["rope_scaling"]
    rope["short_factor"] = list(LONG_FACTOR)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    prompts = _ids(SHORT_PROMPTS)
    assert all(len(ids) + MAX_TOKENS <= ORIGINAL for ids in prompts)
    llm = LLM(path, attention_backend="torch", block_size=8, num_kv_blocks=32, max_model_len=128)
    outs = _check(llm, prompts, _hf_reference(long_only, prompts), "longrope long", min_len=1)
    short = _hf_reference(path, prompts)
    differs = False
    for out, (short_tokens, short_top) in zip(outs, short, strict=True):
        o = out.outputs[0]
        first = o.logprobs[0]
        differs |= short_tokens != o.token_ids or any(
            abs(first[t].logprob - lp) > 1e-3 for t, lp in short_top[0].items() if t in first
        )
    assert differs, "the long and short factors gave the same results: the test checks nothing"
    llm.llm_engine.check_idle()


@pytest.mark.parametrize("sliding_window", [None, 12])
def test_phi3_without_scaling_matches_hf(tmp_path, sliding_window: int | None) -> None:
    """Phi-3's fused qkv_proj / gate_up_proj tensors load straight into the engine's fused layers;
    Phi-3 4k style (no rope scaling, optionally a sliding window) equals transformers."""
    path = make_tiny_hf_model(
        tmp_path, "phi3", initializer_range=0.2, max_position_embeddings=128, sliding_window=sliding_window
    )
    with open(os.path.join(path, "config.json")) as f:
        names = json.load(f)["architectures"]
    assert names == ["Phi3ForCausalLM"]
    prompts = _ids(PROMPTS)
    expected = _hf_reference(path, prompts)
    for backend in ("torch", "cpu"):
        llm = LLM(path, attention_backend=backend, block_size=8, num_kv_blocks=64, max_num_batched_tokens=16)
        _check(llm, prompts, expected, f"phi3 window={sliding_window} {backend}")
        llm.llm_engine.check_idle()


def test_yarn_context_reaches_the_scaled_length(tmp_path) -> None:
    """A YaRN config that keeps its original length as ``max_position_embeddings`` (Qwen2.5's recipe)
    serves ``factor`` times that length by default, and no more."""
    path = make_tiny_hf_model(
        tmp_path,
        "qwen2",
        max_position_embeddings=64,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    )
    llm = LLM(path, num_kv_blocks=64, block_size=8)
    assert llm.llm_engine.max_model_len == 256
    with pytest.raises(ValueError, match="max_model_len 257 is larger than the model's limit of 256"):
        LLM(path, num_kv_blocks=64, block_size=8, max_model_len=257)
