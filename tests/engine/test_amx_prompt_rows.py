"""A prompt token takes the AMX tiles and every other row the integer kernels, whatever the step: the
default model (GGUF Q4_1 projections, a Q8_0 LM head) gives bit-identical prompt logprobs, sampled
tokens and their logprobs for a prompt computed alone in one chunk, in chunks of 8 (a last chunk of
one token), after a prefix-cache hit (its last token recomputed alone), and in steps shared with other
requests' decode rows. Which path each product took is recorded, so the test also fails if the tiles
stop being taken."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import pagedllm.kernels.cpu.quant_linear as quant_linear
from pagedllm import SamplingParams
from pagedllm.kernels.cpu.quant import amx_enabled

pytestmark = pytest.mark.skipif(
    not amx_enabled(), reason="the AMX tiles do not run here (no AMX-BF16 CPU, or PAGEDLLM_CPU_AMX=0)"
)

PROMPT = [1] + [300 + 7 * i for i in range(33)]  # 34 tokens: two full blocks of 16 and two tokens
OTHERS = [[1, 42, 43, 44, 45], [1, 900, 901]]
WITH_PROMPT_LOGPROBS = SamplingParams(
    temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True
)
CACHEABLE = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
DECODING = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def products(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, bool]]]:
    """``(rows, amx)`` of every quantized product, in order."""
    seen: list[tuple[int, bool]] = []
    real = quant_linear.quant_matmul

    def spy(x: torch.Tensor, weight: Any, **kwargs: Any) -> torch.Tensor:
        seen.append((x.shape[0], bool(kwargs.get("amx", False))))
        return real(x, weight, **kwargs)

    monkeypatch.setattr(quant_linear, "quant_matmul", spy)
    yield seen


def result(out: Any) -> tuple[Any, ...]:
    o = out.outputs[0]
    return o.token_ids, o.logprobs, out.prompt_logprobs


def test_prompt_rows_are_the_same_bits_in_any_step(
    make_llm: Any, default_llm: Any, products: list[tuple[int, bool]]
) -> None:
    default_llm.llm_engine.reset_prefix_cache()
    alone = result(default_llm.generate([PROMPT], WITH_PROMPT_LOGPROBS, use_tqdm=False)[0])
    assert (len(PROMPT), True) in products  # the prompt in one product on the tiles
    assert alone[2] is not None and len(alone[2]) == len(PROMPT)
    short = PROMPT[:33]
    short_alone = result(default_llm.generate([short], WITH_PROMPT_LOGPROBS, use_tqdm=False)[0])

    # Chunks of 11: 11, 11, 11 and the last prompt token alone, still on the tiles and attended as
    # a prompt chunk.
    chunked_llm = make_llm(max_num_batched_tokens=11, enable_prefix_caching=False, num_kv_blocks=64)
    products.clear()
    chunked = result(chunked_llm.generate([PROMPT], WITH_PROMPT_LOGPROBS, use_tqdm=False)[0])
    assert (11, True) in products and (1, True) in products and (1, False) in products
    assert chunked == alone, "chunked prefill"
    chunked_llm.llm_engine.check_idle()

    # Prefix-cache hits of 32 tokens (the blocks the runs above registered), leaving two prompt
    # tokens to compute, then one (not run by the native decode layers, which take decode rows only).
    for prompt, expected in ((PROMPT, alone), (short, short_alone)):
        products.clear()
        out = default_llm.generate([prompt], CACHEABLE, use_tqdm=False)[0]
        assert out.num_cached_tokens == 32
        assert products[0] == (len(prompt) - 32, True)
        assert result(out)[:2] == expected[:2], f"after a prefix-cache hit, {len(prompt) - 32} left"

    # Admitted while two other requests decode: its prompt rows share steps with their decode rows.
    default_llm.llm_engine.reset_prefix_cache()
    engine = default_llm.llm_engine
    for i, other in enumerate(OTHERS):
        engine.add_request(f"other-{i}", other, DECODING)
    for _ in range(3):
        engine.step()
    products.clear()
    engine.add_request("target", PROMPT, WITH_PROMPT_LOGPROBS)
    finished: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
    # Mixed steps: a layer's product of prompt rows on the tiles, then of the decode rows.
    assert any(a[1] and b == (len(OTHERS), False) for a, b in zip(products, products[1:], strict=False))
    assert result(finished["target"]) == alone, "batched with decode rows"
    engine.check_idle()
