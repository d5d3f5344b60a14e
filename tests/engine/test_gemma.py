"""Gemma 2 and Gemma 3 (text) tiny random models against HF transformers (fp32, eager attention).

The checkpoints interleave sliding and full layers with a window (8 tokens) far shorter than the
prompts; Gemma 2's has small attention and final-logit soft-caps so that both matter. Every engine
runs with prefix caching, chunked prefill (16-token budget) and a KV pool small enough to force
preemption, in each attention backend.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import copy  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from helpers.model_factory import make_tiny_hf_model  # noqa: E402
from helpers.reference import assert_greedy_close, hf_greedy  # noqa: E402
from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.model.config import ModelConfig  # noqa: E402

WINDOW = 8
MAX_TOKENS = 16
PROMPTS = [
    "The old lighthouse keeper climbed the spiral stairs every evening, counting each step aloud, "
    "because the sea had taught him that small habits keep a mind steady through long storms.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25",
    "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] < b[0] else b.pop(0))\n",
]

TINY_OVERRIDES: dict[str, dict[str, Any]] = {
    # Sliding, full, sliding, full: the local layers rotate with a different RoPE base.
    "gemma3_text": {"sliding_window_pattern": 2},
    "gemma2": {"attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0},
}


class Reference:
    def __init__(self, path: str, hf: Any, ids: list[list[int]]) -> None:
        self.path = path
        self.hf = hf
        self.ids = ids
        self.greedy = [hf_greedy(hf, p, MAX_TOKENS) for p in ids]


@pytest.fixture(scope="module", params=sorted(TINY_OVERRIDES))
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    arch = request.param
    path = make_tiny_hf_model(
        tmp_path_factory.mktemp(arch),
        arch,
        initializer_range=0.2,
        num_hidden_layers=4,
        sliding_window=WINDOW,
        **TINY_OVERRIDES[arch],
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    from helpers.model_factory import default_tokenizer

    ids = [default_tokenizer()(p).input_ids for p in PROMPTS]
    assert min(len(i) for i in ids) > 3 * WINDOW
    return Reference(path, hf, ids)


def _run(reference: Reference, backend: str, num_kv_blocks: int, prompts: int, max_tokens: int) -> LLM:
    llm = LLM(
        reference.path,
        attention_backend=backend,
        block_size=8,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5, ignore_eos=True)
    outs = llm.generate(reference.ids[:prompts], params, use_tqdm=False)
    for ids, out, (hf_tokens, hf_top) in zip(reference.ids, outs, reference.greedy, strict=False):
        assert out.prompt_token_ids == ids
        o = out.outputs[0]
        n = len(o.token_ids)
        assert_greedy_close(o.token_ids, o.logprobs, hf_tokens[:n], hf_top[:n], f"{backend} {ids[:4]}")
        for token, logprob in hf_top[0].items():
            assert abs(o.logprobs[0][token].logprob - logprob) < 1e-3
    return llm


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_gemma_matches_hf(reference: Reference, backend: str) -> None:
    # Three sequences of ~60 tokens need 24 blocks of 8: a pool of 12 preempts.
    llm = _run(reference, backend, num_kv_blocks=12, prompts=3, max_tokens=MAX_TOKENS)
    assert llm.llm_engine.get_stats().num_preemptions > 0
    # Prefix caching: a prompt run twice reuses its cached blocks the second time, same tokens.
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(2):
        again = llm.generate([reference.ids[0]], params, use_tqdm=False)[0]
        assert again.outputs[0].token_ids == reference.greedy[0][0]
    assert again.num_cached_tokens >= 8
    llm.llm_engine.check_idle()


@pytest.mark.slow
def test_gemma_triton_interpreter_matches_hf(reference: Reference) -> None:
    pytest.importorskip("triton")
    llm = _run(reference, "triton", num_kv_blocks=12, prompts=3, max_tokens=MAX_TOKENS)
    assert llm.llm_engine.runner.backend.name == "triton"
    assert llm.llm_engine.get_stats().num_preemptions > 0
    llm.llm_engine.check_idle()


def test_reference_depends_on_window_and_caps(reference: Reference) -> None:
    """The HF reference changes when the window (or Gemma 2's soft-caps) are taken away, so the
    comparisons above check them."""
    longest = max(range(len(PROMPTS)), key=lambda i: len(reference.ids[i]))
    variants = [{"sliding_window": 4096}]
    if reference.hf.config.model_type == "gemma2":
        variants += [{"attn_logit_softcapping": None}, {"final_logit_softcapping": None}]
    for change in variants:
        hf = copy.deepcopy(reference.hf)
        for key, value in change.items():
            setattr(hf.config, key, value)
            for module in hf.modules():  # attention layers copy some of these at construction
                if hasattr(module, key):
                    setattr(module, key, value)
        tokens, top = hf_greedy(hf, reference.ids[longest], MAX_TOKENS)
        base_tokens, base_top = reference.greedy[longest]
        differs = tokens != base_tokens or any(
            abs(top[0][t] - lp) > 1e-3 for t, lp in base_top[0].items() if t in top[0]
        )
        assert differs, f"{reference.hf.config.model_type}: {change} does not change the reference"


def _hf(arch: str = "Gemma3ForCausalLM", **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "architectures": [arch],
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    }
    base.update(extra)
    return base


def test_gemma3_legacy_config_keys() -> None:
    cfg = ModelConfig.from_hf_config(
        _hf(
            rope_theta=500000.0,
            rope_local_base_freq=20000.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            sliding_window=32,
            sliding_window_pattern=3,
        )
    )
    assert cfg.architecture == "gemma3" and cfg.qk_norm
    assert cfg.layer_types == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    assert [cfg.layer_sliding_window(i) for i in range(3)] == [32, 32, None]
    assert (cfg.rope_theta, cfg.rope_local_base_freq) == (500000.0, 20000.0)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.query_pre_attn_scalar == 256 and cfg.tie_word_embeddings
    assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping is None


def test_gemma3_rope_parameters_per_layer_type() -> None:
    cfg = ModelConfig.from_hf_config(
        _hf(
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
        )
    )
    assert (cfg.rope_theta, cfg.rope_local_base_freq, cfg.rope_scaling) == (1e6, 1e4, None)
    assert cfg.layer_sliding_window(0) == 4096 and cfg.layer_sliding_window(5) is None


def test_gemma2_defaults_and_null_caps() -> None:
    cfg = ModelConfig.from_hf_config(_hf("Gemma2ForCausalLM"))
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 3
    assert cfg.rope_local_base_freq is None and not cfg.qk_norm
    off = ModelConfig.from_hf_config(_hf("Gemma2ForCausalLM", final_logit_softcapping=None))
    assert off.final_logit_softcapping is None  # an explicit null disables the cap


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        ({"attention_bias": True}, "attention_bias"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                }
            },
            "sliding_attention",
        ),
    ],
)
def test_gemma_unsupported_options_are_named(extra: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_hf_config(_hf(**extra))


def test_gemma_chat_template_renders_turns() -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from pagedllm.model.tokenizer import GEMMA_CHAT_TEMPLATE

    template = ImmutableSandboxedEnvironment().from_string(GEMMA_CHAT_TEMPLATE)
    messages = [
        {"role": "system", "content": "Be brief. "},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Capital of "}, {"type": "text", "text": "France?"}],
        },
    ]
    assert template.render(messages=messages, add_generation_prompt=True) == (
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nCapital of France?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    assert not template.render(messages=messages[:2], add_generation_prompt=False).endswith("model\n")
