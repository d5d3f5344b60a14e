"""Verification of drafted tokens against the target model's one forward over them.

Row ``i`` of a batch proposed ``n_i`` tokens ``x_0 .. x_{n_i-1}`` (``0 <= n_i <= k``); the target
scored positions ``0 .. n_i``, position ``j`` being the distribution of the token after the context
plus ``x_0 .. x_{j-1}``. Verification emits, per row, the accepted prefix of the proposals and one
more token from the target, so every row emits ``num_accepted + 1`` tokens (``1 .. n_i + 1``):

- greedy rows (:func:`verify_greedy`) accept proposals while they equal the target's argmax, then
  emit the target's argmax at the first mismatch, or the bonus token at position ``n_i``;
- random rows (:func:`rejection_sample`) accept ``x_j`` with probability ``min(1, p_j(x_j) /
  q_j(x_j))``; at the first rejection they emit a draw from the normalised residual
  ``max(0, p_j - q_j)``, and after ``n_i`` acceptances a draw from ``p_{n_i}``. The emitted tokens
  are then distributed exactly as tokens drawn one by one from the target ``p``, whatever the draft
  ``q`` was, provided the proposals really were drawn from ``q`` (a deterministic proposer, such as
  prompt lookup or a greedy draft model, is one-hot ``q``: pass ``draft_probs=None``).

Entries of ``draft_token_ids`` past a row's ``n_i`` are ignored and may hold any value (padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm.sample.sampler import NO_TOKEN, inverse_cdf_sample

PAD_TOKEN = -1


@dataclass
class VerifiedTokens:
    """The tokens each row emits after verification, and the counts behind the acceptance metrics.

    Invariants: ``len(token_ids[i]) == num_accepted[i] + 1``; ``num_accepted[i] <= num_proposed[i]``;
    ``token_ids[i][:num_accepted[i]]`` are the row's first proposals. The last token of a random row
    is :data:`NO_TOKEN` when the target's distribution at that position had no mass (a row whose
    constraints left no token, see ``Sampler.probabilities``).
    """

    token_ids: list[list[int]]
    num_proposed: list[int]
    num_accepted: list[int]

    @property
    def total_proposed(self) -> int:
        return sum(self.num_proposed)

    @property
    def total_accepted(self) -> int:
        return sum(self.num_accepted)

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed tokens of the batch; 0.0 when nothing was proposed."""
        return self.total_accepted / self.total_proposed if self.total_proposed else 0.0


def draft_tensor(
    proposals: Sequence[Sequence[int]], width: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, list[int]]:
    """Per-row proposals of different lengths as one ``[rows, width]`` int64 tensor padded with
    :data:`PAD_TOKEN`, and the per-row counts. Raises ValueError when a row has more than ``width``."""
    counts = [len(p) for p in proposals]
    if any(c > width for c in counts):
        raise ValueError(f"a row proposes {max(counts)} tokens, more than the width {width}")
    padded = [list(p) + [PAD_TOKEN] * (width - len(p)) for p in proposals]
    tensor = torch.tensor(padded, dtype=torch.int64).reshape(len(proposals), width)
    return tensor.to(device), counts


def _check_counts(num_draft_tokens: Sequence[int], rows: int, k: int) -> None:
    if len(num_draft_tokens) != rows:
        raise ValueError(f"num_draft_tokens has {len(num_draft_tokens)} entries for {rows} rows")
    if any(n < 0 or n > k for n in num_draft_tokens):
        raise ValueError(f"num_draft_tokens must be in [0, {k}], got {list(num_draft_tokens)}")


def _accepted_counts(accept: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of accepted proposals per row, counting only the first ``n_i``."""
    k = accept.shape[1]
    in_range = torch.arange(k, device=accept.device)[None, :] < num_draft[:, None]
    return (accept & in_range).to(torch.int64).cumprod(dim=1).sum(dim=1)


def _result(emitted: torch.Tensor, accepted: torch.Tensor, num_draft_tokens: Sequence[int]) -> VerifiedTokens:
    rows: list[list[int]] = emitted.tolist()
    counts: list[int] = accepted.tolist()
    return VerifiedTokens(
        token_ids=[row[: a + 1] for row, a in zip(rows, counts, strict=True)],
        num_proposed=list(num_draft_tokens),
        num_accepted=counts,
    )


def verify_greedy(
    draft_token_ids: torch.Tensor, num_draft_tokens: Sequence[int], target_token_ids: torch.Tensor
) -> VerifiedTokens:
    """Greedy verification: ``draft_token_ids`` is ``[rows, k]``, ``target_token_ids`` ``[rows, k + 1]``
    (the target's argmax at each verified position). Row ``i`` emits ``target_token_ids[i, :a + 1]``,
    ``a`` being the length of the longest prefix of its ``n_i`` proposals equal to the target's."""
    rows, k = draft_token_ids.shape
    if target_token_ids.shape != (rows, k + 1):
        raise ValueError(
            f"target_token_ids must be [rows, k + 1] = {[rows, k + 1]}, got {list(target_token_ids.shape)}"
        )
    _check_counts(num_draft_tokens, rows, k)
    num_draft = torch.tensor(list(num_draft_tokens), dtype=torch.int64, device=draft_token_ids.device)
    accepted = _accepted_counts(draft_token_ids == target_token_ids[:, :k], num_draft)
    return _result(target_token_ids, accepted, num_draft_tokens)


def _uniforms(
    rows: int,
    k: int,
    num_draft_tokens: Sequence[int],
    generators: Sequence[torch.Generator | None],
    device: torch.device,
) -> torch.Tensor:
    """``[rows, k]`` acceptance uniforms in ``[0, 1)``. A row with a generator draws exactly its
    ``n_i`` numbers from it, so a seeded request's draws do not depend on the rest of the batch."""
    u = torch.rand(rows, k, device=device)
    for i, generator in enumerate(generators):
        n = num_draft_tokens[i]
        if generator is not None and n:
            draw = torch.rand(n, generator=generator, device=generator.device)
            u[i, :n] = draw.to(device, non_blocking=True)
    return u


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
) -> VerifiedTokens:
    """Speculative rejection sampling (see the module docstring).

    ``draft_token_ids``: ``[rows, k]``; ``target_probs``: ``[rows, k + 1, vocab]``, each used position
    a normalised distribution (``Sampler.probabilities`` of the target's logits at that position) or
    all zeros; ``draft_probs``: ``[rows, k, vocab]``, the distributions the proposals were drawn from,
    or None for deterministic proposals (one-hot ``q``). ``generators[i]``: row ``i``'s own generator,
    from which it draws its ``n_i`` acceptance numbers and then the one number of its last token;
    rows without one draw from the default generator.
    """
    rows, k = draft_token_ids.shape
    device = target_probs.device
    vocab = target_probs.shape[-1]
    if target_probs.shape != (rows, k + 1, vocab):
        raise ValueError(
            f"target_probs must be [rows, k + 1, vocab] = {[rows, k + 1, vocab]}, got {list(target_probs.shape)}"
        )
    if draft_probs is not None and draft_probs.shape != (rows, k, vocab):
        raise ValueError(
            f"draft_probs must be [rows, k, vocab] = {[rows, k, vocab]}, got {list(draft_probs.shape)}"
        )
    _check_counts(num_draft_tokens, rows, k)
    generators = list(generators) if generators is not None else [None] * rows
    if len(generators) != rows:
        raise ValueError(f"generators has {len(generators)} entries for {rows} rows")
    if rows == 0:
        return VerifiedTokens([], [], [])

    target_probs = target_probs.float()
    draft_probs = None if draft_probs is None else draft_probs.float()
    num_draft = torch.tensor(list(num_draft_tokens), dtype=torch.int64, device=device)
    drafts = draft_token_ids.to(device)
    safe_drafts = drafts.clamp(0, vocab - 1)  # padding past n_i must still index the vocabulary
    p_at = target_probs[:, :k].gather(2, safe_drafts[..., None]).squeeze(2)
    q_at = None if draft_probs is None else draft_probs.gather(2, safe_drafts[..., None]).squeeze(2)
    u = _uniforms(rows, k, num_draft_tokens, generators, device)
    # P(u * q < p) = min(1, p / q) for q > 0; a token the draft gave no mass is kept iff p > 0.
    accept = (u < p_at) if q_at is None else (u * q_at < p_at)
    accepted = _accepted_counts(accept, num_draft)

    row_index = torch.arange(rows, device=device)
    final = target_probs[row_index, accepted]  # p at the first rejection, or p_{n_i} after all accepted
    if k:
        at = accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_final = torch.zeros_like(final)
            q_final[row_index, safe_drafts[row_index, at]] = 1.0
        else:
            q_final = draft_probs[row_index, at]
        residual = (final - q_final).clamp_(min=0.0)
        # p == q leaves no residual: a rejection then only comes from rounding, and p is the draw.
        use_residual = (accepted < num_draft) & (residual.sum(dim=-1) > 0)
        final = torch.where(use_residual[:, None], residual, final)
    empty = final.sum(dim=-1) <= 0
    final = torch.where(empty[:, None], torch.ones_like(final), final)
    last = inverse_cdf_sample(final, generators).masked_fill_(empty, NO_TOKEN)

    emitted = torch.cat([drafts, drafts.new_full((rows, 1), PAD_TOKEN)], dim=1)
    emitted[row_index, accepted] = last
    return _result(emitted, accepted, num_draft_tokens)
