"""Beam search: the hypotheses equal HF transformers' ``generate(num_beams=k, early_stopping=True)``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedllm import BeamSearchOutput, BeamSearchParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 2+2? Answer with one word.<|im_end|>\n<|im_start|>assistant\n",
]
BEAM_WIDTH = 3
MAX_TOKENS = 12


def hf_beam_search(
    model: Any, prompt_ids: list[int], k: int, max_new_tokens: int, eos: list[int], length_penalty: float
) -> list[tuple[list[int], float]]:
    """HF's k finished hypotheses, best first: (prompt + generated token ids, score)."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            num_beams=k,
            num_return_sequences=k,
            do_sample=False,
            early_stopping=True,
            length_penalty=length_penalty,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=eos[0],
            output_scores=True,
            return_dict_in_generate=True,
        )
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()  # generated tokens of each hypothesis
    n = len(prompt_ids)
    return [(out.sequences[i, : n + lengths[i]].tolist(), float(out.sequences_scores[i])) for i in range(k)]


@pytest.fixture(scope="module")
def beam_run(float_llm: Any) -> tuple[list[BeamSearchOutput], int, int]:
    """The outputs, plus the prompt tokens queried and hit in the prefix cache during the search."""
    engine = float_llm.llm_engine
    before = engine.get_stats()
    params = BeamSearchParams(beam_width=BEAM_WIDTH, max_tokens=MAX_TOKENS)
    outs = float_llm.beam_search(PROMPTS, params)
    after = engine.get_stats()
    engine.check_idle()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    return outs, queries, after.prefix_cache_hits - before.prefix_cache_hits


@pytest.fixture(scope="module")
def beam_outputs(beam_run: tuple[list[BeamSearchOutput], int, int]) -> list[BeamSearchOutput]:
    return beam_run[0]


def test_beam_search_matches_hf(
    float_llm: Any, hf_default: tuple[Any, Any], beam_outputs: list[BeamSearchOutput]
) -> None:
    model, _ = hf_default
    engine = float_llm.llm_engine
    assert len(beam_outputs) == len(PROMPTS)
    saw_eos = False
    for prompt, out in zip(PROMPTS, beam_outputs, strict=True):
        prompt_ids = engine.tokenizer.encode(prompt, add_special_tokens=True)
        assert out.prompt_token_ids == prompt_ids
        expected = hf_beam_search(model, prompt_ids, BEAM_WIDTH, MAX_TOKENS, engine.eos_token_ids, 1.0)
        ours = [(s.tokens, s.score) for s in out.sequences]
        # Best beam: exact token ids. All hypotheses: same tokens and scores (fp32 on both sides).
        assert ours[0][0] == expected[0][0], f"{prompt!r}:\nours {ours[0][0]}\nhf   {expected[0][0]}"
        assert [t for t, _ in ours] == [t for t, _ in expected], prompt
        for (_, score), (_, hf_score) in zip(ours, expected, strict=True):
            assert score == pytest.approx(hf_score, abs=2e-3)
        saw_eos |= any(s.finish_reason == "stop" for s in out.sequences)
    assert saw_eos, "no hypothesis ended with EOS: the finishing path is untested"


def test_sequences_sorted_and_consistent(float_llm: Any, beam_outputs: list[BeamSearchOutput]) -> None:
    tokenizer = float_llm.get_tokenizer()
    eos = set(float_llm.llm_engine.eos_token_ids)
    for out in beam_outputs:
        seqs = out.sequences
        assert len(seqs) == BEAM_WIDTH
        scores = [s.score for s in seqs]
        assert scores == sorted(scores, reverse=True)
        for s in seqs:
            generated = s.output_token_ids
            assert s.tokens[: len(out.prompt_token_ids)] == out.prompt_token_ids
            assert 1 <= len(generated) <= MAX_TOKENS
            assert s.score == pytest.approx(s.cum_logprob / len(generated))
            assert s.text == tokenizer.decode(generated, skip_special_tokens=True)
            ends_eos = generated[-1] in eos
            assert s.finish_reason == ("stop" if ends_eos else "length")
            assert ends_eos or len(generated) == MAX_TOKENS
            assert not eos & set(generated[:-1])


def test_beams_share_prefix_blocks(float_llm: Any, beam_run: tuple[list[BeamSearchOutput], int, int]) -> None:
    outs, queries, hits = beam_run
    block = float_llm.llm_engine.config.block_size
    # A prompt's search ran at least as many steps as its longest hypothesis has tokens. At step
    # s > 1 each of its beams is a request of P + s - 1 tokens whose full blocks but the last token's
    # were computed by the previous step's request for its parent beam: all of them are cache hits.
    expected = 0
    for out in outs:
        num_prompt = len(out.prompt_token_ids)
        steps = max(len(s.output_token_ids) for s in out.sequences)
        expected += sum(BEAM_WIDTH * block * ((num_prompt + s - 2) // block) for s in range(2, steps + 1))
    assert expected > 0
    assert queries > hits >= expected


def test_length_penalty_and_ignore_eos(float_llm: Any, hf_default: tuple[Any, Any]) -> None:
    model, _ = hf_default
    engine = float_llm.llm_engine
    prompt = PROMPTS[2]
    params = BeamSearchParams(beam_width=2, max_tokens=8, length_penalty=0.5)
    (out,) = float_llm.beam_search([prompt], params)
    expected = hf_beam_search(model, out.prompt_token_ids, 2, 8, engine.eos_token_ids, 0.5)
    assert [s.tokens for s in out.sequences] == [t for t, _ in expected]

    (out,) = float_llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True))
    assert [len(s.output_token_ids) for s in out.sequences] == [6, 6]
    assert all(s.finish_reason == "length" for s in out.sequences)
    engine.check_idle()


def test_beam_search_rejects_bad_arguments(float_llm: Any) -> None:
    with pytest.raises(ValueError, match="max_logprobs"):
        float_llm.beam_search(["Hi"], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="maximum context length"):
        float_llm.beam_search(["Hi"], BeamSearchParams(beam_width=2, max_tokens=5000))
    with pytest.raises(ValueError, match="empty"):
        float_llm.beam_search([""], BeamSearchParams(beam_width=2, max_tokens=2))
    float_llm.llm_engine.check_idle()
