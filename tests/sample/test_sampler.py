"""Tests of the batched sampler on random logits (no model needed)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.sample import (
    Sampler,
    SamplingInputs,
    apply_logits_processors,
    exponential_noise,
    filter_thresholds,
    make_generator,
    token_counts,
)
from pagedllm.sampling_params import SamplingParams

FAST = settings(max_examples=25, deadline=None)


@pytest.fixture(autouse=True)
def _seed_default_generator() -> None:
    """Unseeded rows draw from the default generator: fix it so every run sees the same draws."""
    torch.manual_seed(1234)


def make_batch(
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    bad_words: list[list[list[int]]] | None = None,
    eos: list[int] | None = None,
) -> SamplingInputs:
    n = len(params)
    return SamplingInputs(
        params=params,
        prompt_token_ids=prompts if prompts is not None else [[] for _ in range(n)],
        output_token_ids=outputs if outputs is not None else [[] for _ in range(n)],
        generators=generators if generators is not None else [None] * n,
        bad_words_token_ids=bad_words,
        eos_token_ids=eos or [],
    )


def draw(
    row: torch.Tensor,
    params: SamplingParams,
    n: int,
    output: list[int] | None = None,
    bad_words: list[list[int]] | None = None,
    eos: list[int] | None = None,
    sampler: Sampler | None = None,
) -> list[int]:
    """``n`` independent samples from one logits row (the row repeated ``n`` times, unseeded)."""
    batch = make_batch(
        [params] * n,
        outputs=[list(output or []) for _ in range(n)],
        bad_words=[bad_words] * n if bad_words is not None else None,
        eos=eos,
    )
    return (sampler or Sampler())(row[None, :].repeat(n, 1), batch).token_ids


def reference_support(
    row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> set[int]:
    """Tokens the filters may keep, computed naively (slightly generous at the top-p / min-p edges)."""
    x = row.double() / temperature
    vocab = x.numel()
    keep = torch.ones(vocab, dtype=torch.bool)
    if 0 < top_k < vocab:
        keep &= x >= x.topk(top_k).values[-1]
    probs = torch.softmax(x.masked_fill(~keep, float("-inf")), dim=0)
    if top_p < 1.0:
        order = probs.argsort(descending=True)
        exclusive = probs[order].cumsum(0) - probs[order]
        last = order[exclusive < top_p + 1e-4][-1]
        keep &= probs >= probs[last]
    if min_p > 0.0:
        keep &= probs >= probs.max() * min_p * (1 - 1e-4)
    return set(keep.nonzero().squeeze(1).tolist())


# ----------------------------------------------------------------------------------------- greedy


@FAST
@given(
    rows=st.integers(1, 8),
    vocab=st.integers(2, 300),
    seed=st.integers(0, 2**16),
    seeded=st.booleans(),
)
def test_greedy_is_argmax(rows: int, vocab: int, seed: int, seeded: bool) -> None:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 4
    generators: list[torch.Generator | None] = [
        make_generator(seed + i) if seeded else None for i in range(rows)
    ]
    out = Sampler()(logits, make_batch([SamplingParams(temperature=0.0)] * rows, generators=generators))
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    expected = torch.log_softmax(logits, dim=-1).gather(1, logits.argmax(dim=-1, keepdim=True)).squeeze(1)
    assert out.sampled_logprobs == pytest.approx(expected.tolist(), abs=1e-5)
    assert out.logprobs == [None] * rows


def test_greedy_rows_in_mixed_batch_take_argmax_of_processed_logits() -> None:
    logits = torch.randn(6, 50) * 3
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(6)]
    params[2] = SamplingParams(temperature=0.0, logit_bias={7: 100.0})
    out = Sampler()(logits, make_batch(params))
    argmax = logits.argmax(dim=-1).tolist()
    assert out.token_ids[0] == argmax[0]
    assert out.token_ids[2] == 7
    assert out.token_ids[4] == argmax[4]


def test_input_logits_are_not_modified_and_low_precision_input_works() -> None:
    logits = torch.randn(4, 40)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.3, logit_bias={1: 5.0}),
        SamplingParams(temperature=1.3, top_p=0.5),
        SamplingParams(temperature=0.0, presence_penalty=1.0),
        SamplingParams(min_p=0.2, logprobs=3),
    ]
    batch = make_batch(params, prompts=[[1, 2, 3]] * 4, outputs=[[4, 4, 5]] * 4)
    Sampler()(logits, batch)
    assert torch.equal(logits, before)
    out = Sampler()(logits.to(torch.bfloat16), batch)
    assert all(0 <= t < 40 for t in out.token_ids)


def test_empty_batch() -> None:
    out = Sampler()(torch.empty(0, 10), make_batch([]))
    assert out.token_ids == [] and out.logprobs == [] and out.sampled_logprobs == []


def test_batch_length_mismatch_is_rejected() -> None:
    batch = make_batch([SamplingParams()] * 2)
    with pytest.raises(ValueError, match="params"):
        Sampler()(torch.randn(3, 10), batch)


# ---------------------------------------------------------------------- top-k / top-p / min-p


@FAST
@given(
    vocab=st.integers(2, 60),
    seed=st.integers(0, 2**16),
    temperature=st.floats(0.3, 2.0),
    top_k=st.sampled_from([-1, 0, 1, 2, 3, 5, 10, 40, 100]),
    top_p=st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.2, 0.01]),
    min_p=st.sampled_from([0.0, 0.05, 0.3, 0.9]),
)
def test_filters_never_sample_outside_their_support(
    vocab: int, seed: int, temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    support = reference_support(row, temperature, top_k, top_p, min_p)
    sampled = set(draw(row, params, 400))
    assert sampled <= support
    assert int(row.argmax()) in support


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p"),
    [(3, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.25), (4, 0.8, 0.0), (5, 0.9, 0.2)],
)
def test_filtered_distribution_is_renormalised_over_the_support(
    top_k: int, top_p: float, min_p: float
) -> None:
    row = torch.tensor([2.0, 1.6, 1.2, 0.9, 0.5, 0.3, 0.0, -0.4, -1.0, -2.0])
    support = sorted(reference_support(row, 1.0, top_k, top_p, min_p))
    expected = torch.softmax(row[support], dim=0)
    n = 20000
    counts = Counter(draw(row, SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p), n))
    assert set(counts) <= set(support)
    for token, p in zip(support, expected.tolist(), strict=True):
        assert counts[token] / n == pytest.approx(p, abs=0.015)


def naive_thresholds(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    out = []
    vocab = probs.shape[1]
    for row, k, p in zip(probs.double(), top_k, top_p, strict=True):
        values = row.sort(descending=True).values
        k = k if 0 < k < vocab else vocab
        values = values[:k]
        if p < 1.0:
            exclusive = values.cumsum(0) - values
            values = values[: max(int((exclusive < p * values.sum()).sum()), 1)]
        out.append(values[-1].item())
    return torch.tensor(out, dtype=torch.float64)


@FAST
@given(
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([0.05, 0.5, 2.0, 6.0]),
    rows=st.lists(
        st.tuples(st.sampled_from([0, 1, 7, 20, 300, 1999]), st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.1])),
        min_size=1,
        max_size=5,
    ),
)
def test_filter_thresholds_match_a_full_sort(seed: int, scale: float, rows: list[tuple[int, float]]) -> None:
    vocab = 2000
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed)) * scale
    probs = logits.softmax(dim=-1)
    top_k = [k for k, _ in rows]
    top_p = [p for _, p in rows]
    expected = naive_thresholds(probs, top_k, top_p)
    # A small candidate set exercises the widening path (near-flat rows need the full vocabulary).
    for candidates in (4, 128, vocab):
        got = filter_thresholds(probs, top_k, top_p, candidates=candidates)
        assert torch.allclose(got.double(), expected, rtol=1e-4, atol=1e-9)
        # Each row's threshold does not depend on the other rows.
        for i in range(len(rows)):
            alone = filter_thresholds(probs[i : i + 1], top_k[i : i + 1], top_p[i : i + 1], candidates)
            assert alone.item() == got[i].item()
    # The GPU's way (interpreted here): rows the first candidate set leaves open settled by a kernel.
    got = filter_thresholds(probs, top_k, top_p, candidates=4, settle_on_device=True)
    assert torch.allclose(got.double(), expected, rtol=1e-4, atol=1e-9)


def test_thresholds_settled_on_the_device_match_a_full_sort() -> None:
    """The path GPUs take: rows the first candidate set leaves open are settled by the Triton kernel
    (interpreted here) instead of being read back and retried. Flat rows, top-k sets wider than the
    candidates with and without top-p, tied values, a vanishing tail and settled rows left alone."""
    vocab = 3000
    gen = torch.Generator().manual_seed(7)
    scales = [0.02, 0.5, 2.0, 6.0, 0.5, 1.0, 1.0, 0.3]
    logits = torch.randn(len(scales), vocab, generator=gen) * torch.tensor(scales)[:, None]
    logits[5] = torch.where(torch.arange(vocab) % 3 == 0, 2.0, -1.0)  # thirds of tied values
    logits[6, 100:] = -200.0  # a tail of exact zeros after the softmax
    probs = logits.softmax(dim=-1)
    top_k = [0, 0, 0, 1500, 700, 1200, 0, 2]
    top_p = [0.9, 0.95, 0.5, 1.0, 0.8, 0.7, 0.999, 1.0]
    expected = naive_thresholds(probs, top_k, top_p)
    for candidates in (4, 128):
        got = filter_thresholds(probs, top_k, top_p, candidates=candidates, settle_on_device=True)
        assert torch.allclose(got.double(), expected, rtol=1e-5, atol=0.0), (candidates, got, expected)
        kept = (probs >= got[:, None]).sum(dim=-1)
        assert kept.tolist() == (probs >= expected.float()[:, None]).sum(dim=-1).tolist()


def test_unfiltered_rows_are_unaffected_by_other_rows_filters() -> None:
    vocab = 30
    row = torch.randn(vocab) * 0.5
    plain = SamplingParams(temperature=1.0, seed=123)
    neighbours = [
        SamplingParams(top_k=1),
        SamplingParams(top_p=0.05),
        SamplingParams(min_p=0.99),
        SamplingParams(temperature=0.0),
    ]
    sampler = Sampler()
    gen_alone = make_generator(123)
    gen_batched = make_generator(123)
    alone, batched = [], []
    for _ in range(20):
        alone += sampler(row[None], make_batch([plain], generators=[gen_alone])).token_ids
        logits = torch.stack(
            [torch.randn(vocab), row, torch.randn(vocab), torch.randn(vocab), torch.randn(vocab)]
        )
        params = [neighbours[0], plain, *neighbours[1:]]
        generators: list[torch.Generator | None] = [None, gen_batched, None, None, None]
        batched.append(sampler(logits, make_batch(params, generators=generators)).token_ids[1])
    assert alone == batched
    assert len(set(alone)) > 5  # a flat row really samples widely
    # Many unseeded draws next to a top-k=1 row still cover the row's whole distribution.
    logits = torch.stack([row, row]).repeat(300, 1)
    out = sampler(logits, make_batch([SamplingParams(), SamplingParams(top_k=1)] * 300))
    assert len(set(out.token_ids[0::2])) > 10
    assert set(out.token_ids[1::2]) == {int(row.argmax())}


# ------------------------------------------------------------------------------------ temperature


def test_temperature_scales_the_distribution() -> None:
    row = torch.tensor([1.5, 1.0, 0.5, 0.0, -0.5])
    n = 20000
    freqs = {}
    for temperature in (0.5, 2.0):
        counts = Counter(draw(row, SamplingParams(temperature=temperature), n))
        expected = torch.softmax(row / temperature, dim=0).tolist()
        freqs[temperature] = [counts[t] / n for t in range(5)]
        assert freqs[temperature] == pytest.approx(expected, abs=0.015)
    assert freqs[0.5][0] > freqs[2.0][0] + 0.2
    assert freqs[0.5][4] < freqs[2.0][4]


def test_tiny_temperature_is_greedy() -> None:
    row = torch.randn(100)
    assert set(draw(row, SamplingParams(temperature=1e-6), 50)) == {int(row.argmax())}


# -------------------------------------------------------------------------------------- penalties


def processed(logits: torch.Tensor, batch: SamplingInputs) -> torch.Tensor:
    out = logits.clone()
    apply_logits_processors(out, batch)
    return out


def test_repetition_penalty_lowers_seen_tokens_and_below_one_raises_them() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -0.5, 0.0]] * 3)
    params = [
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(repetition_penalty=0.5),
        SamplingParams(),
    ]
    batch = make_batch(params, prompts=[[0, 1]] * 3, outputs=[[2]] * 3)
    out = processed(logits, batch)
    assert out[0].tolist() == [1.0, -2.0, 0.25, 1.0, -0.5, 0.0]
    assert out[1].tolist() == [4.0, -0.5, 1.0, 1.0, -0.5, 0.0]
    assert torch.equal(out[2], logits[2])
    # Relative to an unseen token, seen tokens lose probability (penalty > 1) or gain it (< 1).
    before, after = logits.softmax(-1), out.softmax(-1)
    for t in (0, 1, 2):
        assert after[0, t] / after[0, 5] < before[0, t] / before[0, 5]
        assert after[1, t] / after[1, 5] > before[1, t] / before[1, 5]
    assert after[0, 0] < before[0, 0]


def test_frequency_and_presence_penalties_use_output_counts() -> None:
    logits = torch.zeros(4, 6)
    params = [
        SamplingParams(frequency_penalty=0.5),
        SamplingParams(presence_penalty=0.5),
        SamplingParams(frequency_penalty=-1.0, presence_penalty=-0.5),
        SamplingParams(),
    ]
    batch = make_batch(params, prompts=[[5]] * 4, outputs=[[1, 1, 1, 2]] * 4)
    out = processed(logits, batch)
    assert out[0].tolist() == [0.0, -1.5, -0.5, 0.0, 0.0, 0.0]
    assert out[1].tolist() == [0.0, -0.5, -0.5, 0.0, 0.0, 0.0]
    assert out[2].tolist() == [0.0, 3.5, 1.5, 0.0, 0.0, 0.0]  # negative values favour repeats
    assert out[3].tolist() == [0.0] * 6
    probs = out.softmax(-1)
    assert probs[0, 1] < probs[0, 2] < probs[0, 0]
    assert probs[2, 1] > probs[2, 2] > probs[2, 0]


def test_repetition_penalty_changes_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    batch = make_batch([SamplingParams(temperature=0.0, repetition_penalty=1.2)], outputs=[[0]])
    assert Sampler()(logits, batch).token_ids == [1]


@FAST
@given(
    st.lists(st.lists(st.integers(0, 19), max_size=30), min_size=1, max_size=6),
)
def test_token_counts_match_a_counter(token_ids: list[list[int]]) -> None:
    counts = token_counts(token_ids, 20, "cpu")
    for row, ids in zip(counts.tolist(), token_ids, strict=True):
        c = Counter(ids)
        assert row == [float(c[t]) for t in range(20)]


# --------------------------------------------------------------------------- bias and token masks


def test_logit_bias_forces_a_token() -> None:
    row = torch.randn(50) * 3
    assert set(draw(row, SamplingParams(temperature=1.5, logit_bias={17: 100.0}), 200)) == {17}
    top = int(row.argmax())
    greedy = draw(row, SamplingParams(temperature=0.0, logit_bias={top: -100.0}), 1)
    assert greedy != [top]


def test_allowed_token_ids_restrict_sampling() -> None:
    row = torch.randn(50) * 3
    allowed = [3, 8, 41]
    sampled = draw(row, SamplingParams(temperature=2.0, allowed_token_ids=allowed), 500)
    assert set(sampled) == set(allowed)
    # A bias cannot bring back a token outside the allowed set.
    sampled = draw(row, SamplingParams(allowed_token_ids=allowed, logit_bias={0: 100.0}), 200)
    assert set(sampled) <= set(allowed)
    # Other rows of the batch are not restricted.
    logits = row[None].repeat(200, 1)
    params = [
        SamplingParams(temperature=2.0, allowed_token_ids=allowed),
        SamplingParams(temperature=2.0),
    ] * 100
    out = Sampler()(logits, make_batch(params))
    assert set(out.token_ids[0::2]) <= set(allowed)
    assert not set(out.token_ids[1::2]) <= set(allowed)


def test_bad_words_are_never_completed() -> None:
    row = torch.zeros(20)
    params = SamplingParams(logit_bias={7: 100.0, 9: 100.0})
    words = [[5, 6, 7], [9]]
    # The output ends with the prefix 5, 6: token 7 is banned; 9 (single-token word) always is.
    sampled = draw(row, params, 300, output=[1, 5, 6], bad_words=words)
    assert 7 not in sampled and 9 not in sampled
    # Any other context leaves 7 free (and the bias then forces it).
    for output in ([1, 5, 8], [6], [], [6, 5]):
        assert set(draw(row, params, 20, output=output, bad_words=words)) == {7}
    # Greedy rows respect bad words too.
    greedy = SamplingParams(temperature=0.0, logit_bias={7: 100.0})
    assert draw(row, greedy, 1, output=[5, 6], bad_words=words) != [7]


def test_min_tokens_blocks_eos_and_stop_ids() -> None:
    row = torch.zeros(20)
    bias = {2: 100.0, 3: 100.0, 4: 100.0}
    params = SamplingParams(min_tokens=3, stop_token_ids=[3], logit_bias=bias)
    params.all_stop_token_ids = {4}
    for length in (0, 1, 2):
        sampled = draw(row, params, 200, output=list(range(10, 10 + length)), eos=[2])
        assert not {2, 3, 4} & set(sampled)
    assert set(draw(row, params, 200, output=[10, 11, 12], eos=[2])) <= {2, 3, 4}
    # With ignore_eos, EOS does not end generation, so it is not blocked.
    ignore = SamplingParams(
        min_tokens=3, stop_token_ids=[3], ignore_eos=True, logit_bias={2: 100.0, 3: 100.0}
    )
    assert set(draw(row, ignore, 50, output=[10], eos=[2])) == {2}
    greedy = SamplingParams(temperature=0.0, min_tokens=1, logit_bias={2: 100.0})
    assert draw(row, greedy, 1, eos=[2]) != [2]


# ------------------------------------------------------------------------------------------ seeds


def run_steps(
    sampler: Sampler, rows: list[torch.Tensor], params: list[SamplingParams], gens: list, steps: int
) -> list[list[int]]:
    out = []
    for step in range(steps):
        logits = torch.stack([r + 0.1 * step for r in rows])
        out.append(sampler(logits, make_batch(params, generators=gens)).token_ids)
    return out


def test_seeded_rows_reproduce_and_do_not_depend_on_the_batch() -> None:
    torch.manual_seed(0)
    sampler = Sampler()
    vocab = 40
    row = torch.randn(vocab)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7)

    first = run_steps(sampler, [row], [params], [make_generator(7)], 8)
    again = run_steps(sampler, [row], [params], [make_generator(7)], 8)
    assert first == again
    other_seed = run_steps(sampler, [row], [params], [make_generator(8)], 8)
    assert other_seed != first

    others = [torch.randn(vocab) for _ in range(4)]
    batch_params = [
        SamplingParams(seed=1),
        SamplingParams(),
        params,
        SamplingParams(temperature=0.5, top_k=3),
        SamplingParams(temperature=0.0, seed=3),
    ]
    gen = make_generator(7)
    gens = [make_generator(1), None, gen, None, make_generator(3)]
    batched = run_steps(sampler, [others[0], others[1], row, others[2], others[3]], batch_params, gens, 8)
    assert [step[2] for step in batched] == [step[0] for step in first]
    # The generator advanced exactly as much as when the row was alone.
    alone_gen = make_generator(7)
    run_steps(sampler, [row], [params], [alone_gen], 8)
    assert torch.equal(gen.get_state(), alone_gen.get_state())


def test_greedy_rows_do_not_consume_their_generator() -> None:
    gen = make_generator(5)
    state = gen.get_state()
    Sampler()(
        torch.randn(2, 10), make_batch([SamplingParams(temperature=0.0, seed=5)] * 2, generators=[gen, None])
    )
    assert torch.equal(gen.get_state(), state)


def test_exponential_noise_draws_one_row_per_seeded_generator() -> None:
    gen = make_generator(11)
    noise = exponential_noise(3, 20000, [None, gen, None], torch.device("cpu"))
    reference = make_generator(11)
    expected = -torch.empty(20000).uniform_(generator=reference).log()
    assert torch.equal(noise[1], expected)
    assert torch.equal(gen.get_state(), reference.get_state())
    assert bool((noise > 0).all())
    assert abs(noise.mean().item() - 1.0) < 0.03  # Exp(1): the mean of 60000 draws is within 0.004 (1 sd)


# ---------------------------------------------------------------------------------------- logprobs


@FAST
@given(
    vocab=st.integers(2, 200),
    seed=st.integers(0, 2**16),
    num_logprobs=st.integers(0, 8),
    greedy=st.booleans(),
)
def test_logprobs_are_raw_with_correct_ranks(vocab: int, seed: int, num_logprobs: int, greedy: bool) -> None:
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    processed_params = SamplingParams(
        temperature=0.0 if greedy else 0.7,
        logprobs=num_logprobs,
        repetition_penalty=1.5,
        logit_bias={0: 5.0},
        top_k=3,
    )
    params = [processed_params, SamplingParams(), SamplingParams(logprobs=num_logprobs, min_p=0.1)]
    out = Sampler()(logits, make_batch(params, prompts=[[1, 2]] * 3, outputs=[[0]] * 3))
    reference = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[1] is None
    for i in (0, 2):
        entry = out.logprobs[i]
        assert entry is not None
        token = out.token_ids[i]
        k = min(num_logprobs, vocab)
        top = reference[i].topk(k).indices.tolist()
        assert set(entry) == {token, *top}
        assert len(entry) in (k, k + 1)
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(reference[i, tid].item(), abs=1e-5)
            assert lp.rank == 1 + int((logits[i] > logits[i, tid]).sum())
        assert [entry[t].rank for t in top] == list(range(1, k + 1))
        assert out.sampled_logprobs[i] == pytest.approx(reference[i, token].item(), abs=1e-5)
    assert out.sampled_logprobs[1] == pytest.approx(reference[1, out.token_ids[1]].item(), abs=1e-5)


def test_zero_logprobs_reports_only_the_sampled_token() -> None:
    logits = torch.randn(1, 30)
    out = Sampler()(logits, make_batch([SamplingParams(logprobs=0, temperature=0.0)]))
    token = out.token_ids[0]
    entry = out.logprobs[0]
    assert entry is not None and list(entry) == [token]
    assert entry[token].rank == 1
    assert entry[token].logprob == pytest.approx(torch.log_softmax(logits[0], 0)[token].item(), abs=1e-6)


def test_sampling_queues_work_without_waiting_for_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """What lets the engine schedule ahead on a GPU: sampling only queues work. On the meta device
    (shapes, no data) any read of device data raises, and a patched ``Tensor.to`` records every
    host-to-device copy that would block the host until the device is idle."""
    blocking: list[tuple[int, ...]] = []
    original_to = torch.Tensor.to

    def checked_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = original_to(self, *args, **kwargs)
        if self.device.type == "cpu" and out.device.type == "meta" and not kwargs.get("non_blocking"):
            blocking.append(tuple(self.shape))
        return out

    monkeypatch.setattr(torch.Tensor, "to", checked_to)
    vocab = 1000  # wider than the 128 candidates top-p looks at first
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=300, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=5, min_p=0.1),
        SamplingParams(temperature=0.9, seed=3),
        SamplingParams(temperature=0, logit_bias={3: 2.0, 9: -1.0}, logprobs=2),
        SamplingParams(temperature=0.5, allowed_token_ids=[1, 2, 3]),
        SamplingParams(temperature=0, min_tokens=4, stop_token_ids=[7]),
        SamplingParams(temperature=0, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3),
    ]
    n = len(params)
    generators = [None] * n
    generators[3] = make_generator(3)
    batch = make_batch(
        params,
        prompts=[[1, 2, 70]] * n,  # 70 is outside the vocabulary: ignored by the penalties
        outputs=[[4, 4, 5]] * n,
        generators=generators,
        bad_words=[[[4, 9]]] + [[]] * (n - 1),
        eos=[0],
    )
    sampled = Sampler().sample(torch.empty(n, vocab, device="meta"), batch)
    assert sampled.token_ids.device.type == "meta" and sampled.token_ids.shape == (n,)
    assert sampled.ranks is not None and sampled.ranks.shape == (1,)
    assert not blocking, f"blocking host-to-device copies of shapes {blocking}"
