"""Verification of proposed tokens: greedy matching, and rejection sampling, whose output must be
distributed exactly as tokens drawn from the target one by one.

The distribution tests draw many rows with fixed seeds (so each run sees the same draws) and accept
at the 0.001 significance level: a chi-square p-value below 0.001 fails the test. The main ones also
check that the same number of samples would tell a wrong distribution from the target's, so that
passing is not for want of power.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.sample import Sampler, SamplingInputs, make_generator
from pagedllm.sample.sampler import NO_TOKEN
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec import VerifiedTokens, draft_tensor, rejection_sample, verify_greedy

ALPHA = 1e-3
VOCAB = 6
N = 60_000

# Target distributions: p0 at the first position, p1[a] after token a, p2[b] after token b. Token 5
# has no mass at the first position, which the draft below does propose.
P0 = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10, 0.0])
P1 = torch.softmax(torch.arange(VOCAB * VOCAB, dtype=torch.float32).reshape(VOCAB, VOCAB).sin() * 2, dim=-1)
P2 = torch.softmax(torch.arange(VOCAB * VOCAB, dtype=torch.float32).reshape(VOCAB, VOCAB).cos() * 2, dim=-1)
# A draft that is deliberately different.
Q0 = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.25, 0.25])
Q1 = torch.softmax(torch.arange(VOCAB * VOCAB, dtype=torch.float32).reshape(VOCAB, VOCAB).cos() * 3, dim=-1)


@pytest.fixture(autouse=True)
def _seed_default_generator() -> None:
    torch.manual_seed(2024)


def chi2_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness-of-fit p-value of ``observed`` counts against ``probs``. Cells of
    zero probability must be empty and are left out of the statistic."""
    observed = observed.double()
    expected = probs.double() / probs.double().sum() * observed.sum()
    zero = expected == 0
    assert observed[zero].sum() == 0, f"tokens of zero probability were drawn: {observed[zero].tolist()}"
    obs, exp = observed[~zero], expected[~zero]
    statistic = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), statistic / 2))


def test_chi2_pvalue_matches_known_quantiles() -> None:
    # The 0.05 critical values of chi-square with 1 and 5 degrees of freedom: 3.841 and 11.070.
    offset = math.sqrt(3.841 * 25)  # two cells of 50 expected: statistic = 2 * offset**2 / 50
    assert chi2_pvalue(torch.tensor([50 + offset, 50 - offset]), torch.ones(2)) == pytest.approx(
        0.05, abs=1e-3
    )
    p_value = torch.special.gammaincc(torch.tensor(2.5, dtype=torch.float64), torch.tensor(11.070 / 2))
    assert float(p_value) == pytest.approx(0.05, abs=1e-3)


def noncentrality(wrong: torch.Tensor, right: torch.Tensor, samples: int) -> float:
    """The expected chi-square statistic, less its degrees of freedom, of ``samples`` draws from
    ``wrong`` tested against ``right``: far above the critical value means the test would fail."""
    keep = right > 0
    return samples * float((((wrong - right) ** 2)[keep] / right[keep]).sum())


def counts(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=VOCAB)


def first_tokens(result: VerifiedTokens) -> list[int]:
    return [row[0] for row in result.token_ids]


def assert_matches_target(result: VerifiedTokens, drafts: torch.Tensor) -> None:
    """The first emitted token is p0-distributed, the second given the first p1[first], the third
    given the second p2[second]; and the first two tokens of the sequence (a row that stopped after
    one token draws its second from the target, as the next step would) are jointly p0 x p1."""
    rows = result.token_ids
    assert chi2_pvalue(counts(first_tokens(result)), P0) > ALPHA
    for a in range(VOCAB):
        seconds = [row[1] for row in rows if len(row) >= 2 and row[0] == a]
        if len(seconds) >= 200:
            assert chi2_pvalue(counts(seconds), P1[a]) > ALPHA, a
        thirds = [row[2] for row in rows if len(row) == 3 and row[1] == a]
        if len(thirds) >= 200:
            assert chi2_pvalue(counts(thirds), P2[a]) > ALPHA, a
    first = torch.tensor(first_tokens(result))
    continued = torch.multinomial(P1[first], 1, generator=torch.Generator().manual_seed(99)).squeeze(1)
    second = torch.tensor([row[1] if len(row) >= 2 else -1 for row in rows])
    second = torch.where(second >= 0, second, continued)
    pairs = torch.bincount(first * VOCAB + second, minlength=VOCAB * VOCAB)
    assert chi2_pvalue(pairs, (P0[:, None] * P1).flatten()) > ALPHA
    for i, row in enumerate(rows[:200]):
        assert row[:-1] == drafts[i, : len(row) - 1].tolist()


def sampled_drafts(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``N`` rows of two tokens drawn from the draft, and the draft's distributions behind them."""
    x0 = torch.multinomial(Q0, N, replacement=True, generator=generator)
    x1 = torch.multinomial(Q1[x0], 1, generator=generator).squeeze(1)
    return torch.stack([x0, x1], dim=1), torch.stack([Q0.expand(N, VOCAB), Q1[x0]], dim=1)


def target_for(drafts: torch.Tensor) -> torch.Tensor:
    """``[rows, 3, vocab]``: the target's distribution at each position given the drafted context."""
    rows = drafts.shape[0]
    return torch.stack([P0.expand(rows, VOCAB), P1[drafts[:, 0]], P2[drafts[:, 1]]], dim=1)


def test_sampled_draft_keeps_the_target_distribution() -> None:
    drafts, draft_probs = sampled_drafts(torch.Generator().manual_seed(1))
    result = rejection_sample(drafts, [2] * N, target_for(drafts), draft_probs)
    assert_matches_target(result, drafts)
    assert 0.2 < result.acceptance_rate < 0.9  # the draft is neither useless nor the target
    assert chi2_pvalue(counts(drafts[:, 0].tolist()), Q0) > ALPHA  # the harness draws from q
    assert counts(drafts[:, 0].tolist())[5] > 0  # a token the target never emits first
    # Power: emitting the proposals as they are, or the classic mistake of drawing from p instead of
    # the residual after a rejection, would fail the first-token test by far (the 0.001 critical
    # value of chi-square with 4 degrees of freedom is 18.5).
    assert noncentrality(Q0, P0, N) > 1000
    kept = torch.minimum(P0, Q0)
    assert noncentrality(kept + (1 - kept.sum()) * P0, P0, N) > 200


def test_one_hot_draft_keeps_the_target_distribution() -> None:
    """Prompt-lookup proposals are deterministic: q is one-hot on the proposed token."""
    drafts = torch.tensor([[1, 3]]).expand(N, 2)
    result = rejection_sample(drafts, [2] * N, target_for(drafts))
    assert_matches_target(result, drafts)
    # Power: drawing from p instead of p without the rejected proposal would fail by far.
    wrong = (1 - P0[1]) * P0
    wrong[1] += P0[1]
    assert noncentrality(wrong, P0, N) > 200


def test_identical_draft_is_always_accepted() -> None:
    generator = torch.Generator().manual_seed(5)
    x0 = torch.multinomial(P0, N, replacement=True, generator=generator)
    x1 = torch.multinomial(P1[x0], 1, generator=generator).squeeze(1)
    drafts = torch.stack([x0, x1], dim=1)
    target = target_for(drafts)
    result = rejection_sample(drafts, [2] * N, target, target[:, :2])
    assert result.acceptance_rate == 1.0
    assert result.num_accepted == [2] * N
    bonus = [row[2] for row in result.token_ids]
    assert all(row[:2] == drafts[i].tolist() for i, row in enumerate(result.token_ids[:500]))
    assert chi2_pvalue(counts([b for b, x in zip(bonus, x1.tolist(), strict=True) if x == 2]), P2[2]) > ALPHA


def test_rows_propose_different_numbers_of_tokens() -> None:
    """A row with ``n`` proposals takes its bonus token from position ``n``."""
    drafts, draft_probs = sampled_drafts(torch.Generator().manual_seed(3))
    num = [i % 3 for i in range(N)]
    drafts[[i for i in range(N) if num[i] < 2], 1] = -1  # padding past a row's count is ignored
    result = rejection_sample(drafts, num, target_for(drafts), draft_probs)
    assert result.num_proposed == num
    for n in range(3):
        rows = [result.token_ids[i] for i in range(N) if num[i] == n]
        assert all(1 <= len(row) <= n + 1 for row in rows)
        assert chi2_pvalue(counts([row[0] for row in rows]), P0) > ALPHA
    assert all(len(row) == 1 for i, row in enumerate(result.token_ids) if num[i] == 0)
    # Rows of one proposal that kept it end with a bonus drawn from p1[their proposal].
    kept = [row[1] for i, row in enumerate(result.token_ids) if num[i] == 1 and len(row) == 2 and row[0] == 2]
    assert chi2_pvalue(counts(kept), P1[2]) > ALPHA


def test_seeded_rows_draw_from_their_own_generator() -> None:
    drafts, draft_probs = sampled_drafts(torch.Generator().manual_seed(4))
    drafts, draft_probs = drafts[:40], draft_probs[:40]
    target = target_for(drafts)

    def run(rows: list[int], seeds: dict[int, int]) -> list[list[int]]:
        generators = [make_generator(seeds[r]) if r in seeds else None for r in rows]
        return rejection_sample(
            drafts[rows], [2] * len(rows), target[rows], draft_probs[rows], generators
        ).token_ids

    seeds = {r: 1000 + r for r in range(40)}
    alone = [run([r], seeds)[0] for r in range(40)]
    torch.manual_seed(7)  # the unseeded neighbours draw differently; the seeded rows must not care
    mixed = run(list(range(40)), {r: s for r, s in seeds.items() if r % 2 == 0})
    assert [mixed[r] for r in range(0, 40, 2)] == [alone[r] for r in range(0, 40, 2)]
    assert run(list(range(40)), seeds) == alone
    reseeded = [run([r], {r: 5000 + r})[0] for r in range(40)]
    assert reseeded != alone  # the seed does decide the outcome


GREEDY_CASES = [
    # (proposals, target argmax at each position, emitted, accepted)
    ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8], 3),  # all accepted, plus the bonus token
    ([5, 9, 7], [5, 6, 7, 8], [5, 6], 1),  # the target's token at the first mismatch
    ([1, 6, 7], [5, 6, 7, 8], [5], 0),
    ([5, 6], [5, 6, 3, 8], [5, 6, 3], 2),  # two proposals: the bonus is at position 2
    ([], [4, 1, 2, 3], [4], 0),  # nothing proposed: one ordinary token
]


def test_greedy_verification() -> None:
    drafts, num = draft_tensor([case[0] for case in GREEDY_CASES], 3)
    assert num == [3, 3, 3, 2, 0]
    assert drafts[3].tolist() == [5, 6, -1]
    target = torch.tensor([case[1] for case in GREEDY_CASES])
    result = verify_greedy(drafts, num, target)
    assert result.token_ids == [case[2] for case in GREEDY_CASES]
    assert result.num_accepted == [case[3] for case in GREEDY_CASES]
    assert result.num_proposed == [3, 3, 3, 2, 0]
    assert (result.total_proposed, result.total_accepted) == (11, 6)
    assert result.acceptance_rate == pytest.approx(6 / 11)


def test_padding_that_equals_the_target_is_not_accepted() -> None:
    result = verify_greedy(torch.tensor([[5, 8]]), [1], torch.tensor([[5, 8, 8]]))
    assert result.token_ids == [[5, 8]] and result.num_accepted == [1]


def test_greedy_rows_through_rejection_sampling_match_greedy_verification() -> None:
    """``Sampler.probabilities`` makes a greedy row one-hot, which rejection sampling verifies exactly
    as greedy matching does."""
    generator = torch.Generator().manual_seed(8)
    rows, k, vocab = 64, 3, 12
    logits = torch.randn(rows * (k + 1), vocab, generator=generator)
    params = [SamplingParams(temperature=0.0)] * (rows * (k + 1))
    batch = SamplingInputs(params, [[]] * len(params), [[]] * len(params), [None] * len(params))
    target = Sampler().probabilities(logits, batch).reshape(rows, k + 1, vocab)
    argmax = logits.argmax(dim=-1).reshape(rows, k + 1)
    # Proposals that agree with the target's argmax for a random number of leading positions.
    agree = torch.randint(0, k + 1, (rows,), generator=generator)
    drafts = torch.where(
        torch.arange(k)[None, :] < agree[:, None], argmax[:, :k], (argmax[:, :k] + 1) % vocab
    )
    num = torch.randint(0, k + 1, (rows,), generator=generator).tolist()
    greedy = verify_greedy(drafts, num, argmax)
    assert rejection_sample(drafts, num, target) == greedy
    assert greedy.num_accepted == [min(a, n) for a, n in zip(agree.tolist(), num, strict=True)]


def test_a_target_without_tokens_emits_no_token() -> None:
    target = torch.zeros(2, 2, VOCAB)
    target[1, 0] = P0
    result = rejection_sample(torch.tensor([[2], [5]]), [1, 1], target)
    assert result.token_ids[0] == [NO_TOKEN]
    assert result.token_ids[1][0] != 5  # p0 gives token 5 no mass: always rejected, then redrawn


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: verify_greedy(torch.zeros(2, 3, dtype=torch.long), [1, 1], torch.zeros(2, 3)),
            "target_token_ids",
        ),
        (
            lambda: verify_greedy(torch.zeros(2, 3, dtype=torch.long), [1, 4], torch.zeros(2, 4)),
            "num_draft_tokens",
        ),
        (
            lambda: rejection_sample(torch.zeros(2, 2, dtype=torch.long), [1, 1], torch.zeros(2, 2, 5)),
            "target_probs",
        ),
        (
            lambda: rejection_sample(
                torch.zeros(1, 2, dtype=torch.long), [1], torch.zeros(1, 3, 5), torch.zeros(1, 2, 4)
            ),
            "draft_probs",
        ),
        (
            lambda: rejection_sample(
                torch.zeros(1, 2, dtype=torch.long), [1], torch.zeros(1, 3, 5), None, []
            ),
            "generators",
        ),
        (lambda: draft_tensor([[1, 2, 3]], 2), "width"),
    ],
)
def test_shape_errors(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]


# --- Sampler.probabilities: the distribution the sampler draws from --------------------------------


PARAMS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.2, top_k=4),
    SamplingParams(temperature=0.9, top_p=0.7),
    SamplingParams(temperature=1.0, min_p=0.15, repetition_penalty=1.5),
    SamplingParams(temperature=0.8, top_k=6, top_p=0.9, logit_bias={2: 1.5}),
]


def test_probabilities_are_what_the_sampler_draws_from() -> None:
    """Sampling each configuration many times reproduces ``probabilities`` (chi-square, 0.001)."""
    vocab, repeats = 10, 8000
    logits = torch.randn(len(PARAMS), vocab, generator=torch.Generator().manual_seed(11)) * 1.5
    prompt, output = [[1, 3]], [[3, 7]]
    batch = SamplingInputs(list(PARAMS), prompt * len(PARAMS), output * len(PARAMS), [None] * len(PARAMS))
    probs = Sampler().probabilities(logits, batch)
    assert torch.allclose(probs.sum(dim=-1), torch.ones(len(PARAMS)))
    assert (probs[1] > 0).sum() == 4  # top-k = 4 keeps four tokens
    rows = len(PARAMS) * repeats
    big = SamplingInputs(list(PARAMS) * repeats, prompt * rows, output * rows, [None] * rows)
    tokens = Sampler()(logits.repeat(repeats, 1), big).token_ids
    for i in range(len(PARAMS)):
        drawn = torch.bincount(torch.tensor(tokens[i :: len(PARAMS)]), minlength=vocab)
        assert chi2_pvalue(drawn, probs[i]) > ALPHA, PARAMS[i]
    # Power: the same draws tell the top-k row from its unfiltered softmax.
    drawn = torch.bincount(torch.tensor(tokens[1 :: len(PARAMS)]), minlength=vocab)
    assert chi2_pvalue(drawn, (logits[1] / 1.2).softmax(dim=-1)) < 1e-6


def test_probabilities_of_greedy_and_empty_rows() -> None:
    logits = torch.tensor([[0.1, 2.0, 1.0, -1.0], [0.1, 2.0, 1.0, -1.0], [float("-inf")] * 4])
    kept = logits.clone()
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias={3: 5.0}),
        SamplingParams(),
    ]
    generator = make_generator(3)
    batch = SamplingInputs(params, [[]] * 3, [[]] * 3, [None, None, generator], masked_rows=[2])
    state = generator.get_state()
    probs = Sampler().probabilities(logits, batch)
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.0] * 4]
    assert torch.equal(logits, kept)
    assert torch.equal(generator.get_state(), state)
