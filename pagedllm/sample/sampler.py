"""Batched next-token sampling.

The :class:`Sampler` takes the last-position logits of every sequence that needs a new token and
returns one token per row, in the order vLLM v1 uses:

1. log probabilities for reporting, from the raw model logits;
2. the logits processors of :mod:`pagedllm.sample.logits_processors`: penalties, ``logit_bias``,
   ``allowed_token_ids``, ``bad_words``, ``min_tokens``;
3. greedy rows take the argmax of the processed logits; random rows go through temperature, top-k,
   top-p and min-p and are sampled with the exponential race ``argmax(probs / q)``, ``q ~ Exp(1)``
   (on GPUs), or by inverse transform sampling with one uniform number per row (on the CPU, where
   drawing a vocabulary's worth of noise per row costs more than the rest of sampling).

Every step is a batch tensor operation; Python only builds the small per-row parameter tensors.
A row with a per-request ``torch.Generator`` draws its noise from that generator alone, so a seeded
request produces the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedllm.kernels.cpu import ops as cpu_ops
from pagedllm.outputs import Logprob
from pagedllm.sample.logits_processors import apply_logits_processors, index_tensor, needs_logits_processing
from pagedllm.sample.penalties import device_tensor
from pagedllm.sample.sampling_inputs import SamplingInputs
from pagedllm.sampling_params import SamplingParams

# The token id of a row that had no token left to sample (see Sampler.sample).
NO_TOKEN = -1


@dataclass
class SampledTokens:
    """The sampled token of every row and, where requested, its log probabilities.

    ``logprobs[i]`` is None unless ``params[i].logprobs`` is set; otherwise it maps the sampled token
    and the ``params[i].logprobs`` most likely tokens to their :class:`Logprob` (log probability under
    the raw model distribution and 1-based rank in it). ``sampled_logprobs[i]`` is the raw log
    probability of the sampled token, for the cumulative log probability of the sequence.
    ``token_ids[i]`` is :data:`NO_TOKEN` when the row's constraints left no token to sample.
    """

    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]
    sampled_logprobs: list[float]
    # Speculative decoding: the draft tokens row i accepted, emitted before ``token_ids[i]``, and
    # their raw log probabilities (empty lists for rows without drafts; None for a step without).
    accepted: list[list[int]] | None = None
    accepted_logprobs: list[list[float]] | None = None


@dataclass
class DeviceSamples:
    """One step's sampling results, still where the logits were (see :meth:`Sampler.sample`).

    Only :meth:`output` waits for the device. On a GPU, :meth:`copy_to_host` first queues the copies
    to pinned host memory behind the sampling kernels, so that ``output`` waits for this step's work
    alone, not for whatever the host queued on the device after it (the next step's forward).
    """

    token_ids: torch.Tensor  # [rows] int64
    sampled_logprobs: torch.Tensor  # [rows] float32: raw log probability of each sampled token
    params: Sequence[SamplingParams]
    logprob_rows: list[int] = field(default_factory=list)  # rows that asked for logprobs
    ranks: torch.Tensor | None = None  # [len(logprob_rows)]: 1-based rank of the sampled token
    top_ids: torch.Tensor | None = None  # [len(logprob_rows), max k]
    top_logprobs: torch.Tensor | None = None  # [len(logprob_rows), max k]
    no_token: torch.Tensor | None = None  # [rows] bool: no token was allowed (None: none checked)
    _copied: torch.cuda.Event | None = None

    def copy_to_host(self) -> None:
        """Queue non-blocking copies of the results to pinned host memory (a no-op off CUDA)."""
        if self.token_ids.device.type != "cuda" or self._copied is not None:
            return
        for name in ("token_ids", "sampled_logprobs", "ranks", "top_ids", "top_logprobs", "no_token"):
            value = getattr(self, name)
            if value is not None:
                host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                setattr(self, name, host.copy_(value, non_blocking=True))
        self._copied = torch.cuda.Event()
        self._copied.record()

    def output(self) -> SampledTokens:
        """The results as Python values (waits for the device)."""
        if self._copied is not None:
            self._copied.synchronize()
        token_ids: list[int] = self.token_ids.tolist()
        if self.no_token is not None and bool(self.no_token.any()):
            for i in self.no_token.nonzero().flatten().tolist():
                token_ids[i] = NO_TOKEN
        sampled: list[float] = self.sampled_logprobs.tolist()
        logprobs: list[dict[int, Logprob] | None] = [None] * len(token_ids)
        if self.ranks is not None:
            ranks: list[int] = self.ranks.tolist()
            top_ids: list[list[int]] = self.top_ids.tolist() if self.top_ids is not None else []
            top_lps: list[list[float]] = self.top_logprobs.tolist() if self.top_logprobs is not None else []
            for j, i in enumerate(self.logprob_rows):
                token = token_ids[i]
                entry = {token: Logprob(logprob=sampled[i], rank=ranks[j])}
                k = self.params[i].logprobs or 0
                if k:
                    for rank, (tid, lp) in enumerate(zip(top_ids[j][:k], top_lps[j][:k], strict=True), 1):
                        if tid != token:
                            entry[tid] = Logprob(logprob=lp, rank=rank)
                logprobs[i] = entry
        return SampledTokens(token_ids=token_ids, logprobs=logprobs, sampled_logprobs=sampled)


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one seeded request, on the device the logits live on."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def filter_thresholds(
    probs: torch.Tensor,
    top_k: Sequence[int],
    top_p: Sequence[float],
    candidates: int = 128,
    settle_on_device: bool | None = None,
) -> torch.Tensor:
    """Per-row probability threshold of top-k then top-p: tokens with ``prob >= threshold`` stay.

    ``probs`` is ``[num_rows, vocab]``; ``top_k[i]`` of 0, -1 or at least the vocabulary size and
    ``top_p[i] == 1`` switch the filters off for row ``i``. Top-k keeps the ``k`` most likely tokens;
    top-p then keeps, of the distribution renormalised over those, the most likely tokens up to and
    including the first one at which the cumulative probability reaches ``top_p``. Tokens tied with
    the last kept one are kept as well.

    No row sorts the whole vocabulary unless it has to: each row looks at the ``max(k, candidates)``
    most likely tokens (``k`` capped at ``candidates`` for top-p rows), and only rows whose nucleus is
    not inside them retry with 16 times as many, then with the full vocabulary. The result of a row
    depends on that row alone.

    Finding those rows reads a flag back from the device. With ``settle_on_device`` (the default off
    the CPU) nothing is read back: a Triton kernel settles the rows the first candidate set left
    open on the device, see :mod:`pagedllm.kernels.triton.sampling`.
    """
    num_rows, vocab_size = probs.shape
    device = probs.device
    ks = [k if 0 < k < vocab_size else vocab_size for k in top_k]
    needed = [k if p >= 1.0 else min(k, candidates) for k, p in zip(ks, top_p, strict=True)]
    width = min(max(max(needed, default=1), candidates, 1), vocab_size)
    k_all = device_tensor(ks, torch.int64, device)
    p_all = device_tensor(top_p, probs.dtype, device)
    # Cumulative sums in float64: a float32 running sum over thousands of tokens drifts by more than
    # the smallest probabilities, which would move a nucleus boundary by a token.
    p_all64 = device_tensor(top_p, torch.float64, device)
    thresholds = probs.new_zeros(num_rows)
    remaining: torch.Tensor | None = None  # rows still to settle; None: all of them
    while True:
        rows_probs = probs if remaining is None else probs.index_select(0, remaining)
        k = k_all if remaining is None else k_all.index_select(0, remaining)
        p = p_all64 if remaining is None else p_all64.index_select(0, remaining)
        if width == vocab_size:
            values = rows_probs.sort(dim=-1, descending=True).values
        else:
            values = rows_probs.topk(width, dim=-1).values
        cumulative = values.cumsum(dim=-1, dtype=torch.float64)
        exclusive = torch.nn.functional.pad(cumulative[:, :-1], (1, 0))
        k_in = k.clamp(max=width)
        # Mass top-p is relative to: the top-k set, or the whole row when top-k is off.
        mass = torch.where(
            k < vocab_size,
            cumulative.gather(1, (k_in - 1)[:, None]).squeeze(1),
            rows_probs.sum(dim=-1, dtype=torch.float64),
        )
        nucleus_size = (exclusive < (p * mass)[:, None]).sum(dim=-1)
        num_kept = torch.where(p < 1.0, torch.minimum(nucleus_size, k_in), k_in).clamp_(min=1)
        rows_thresholds = values.gather(1, (num_kept - 1)[:, None]).squeeze(1)
        if width == vocab_size:
            done = None
        else:
            # Settled: the whole top-k set is in view, or (top-k off) the nucleus ends in view.
            done = (k <= width) | ((k == vocab_size) & (cumulative[:, -1] >= p * mass))
        if remaining is None:
            thresholds = rows_thresholds if done is None else torch.where(done, rows_thresholds, thresholds)
            if done is not None and (device.type != "cpu" if settle_on_device is None else settle_on_device):
                from pagedllm.kernels.triton.sampling import settle_thresholds  # needs triton

                settle_thresholds(probs.contiguous(), k_all, p_all, done, thresholds)
                return thresholds
        elif done is None:
            thresholds.index_copy_(0, remaining, rows_thresholds)
        else:
            thresholds.index_copy_(0, remaining[done], rows_thresholds[done])
        if done is None or bool(done.all()):
            return thresholds
        remaining = (~done).nonzero().squeeze(1) if remaining is None else remaining[~done]
        # topk over a large share of the vocabulary costs as much as sorting all of it.
        width = width * 16 if width * 16 <= vocab_size // 4 else vocab_size


def exponential_noise(
    num_rows: int,
    vocab_size: int,
    generators: Sequence[torch.Generator | None],
    device: torch.device,
) -> torch.Tensor:
    """``Exp(1)`` noise of shape ``[num_rows, vocab_size]`` for the exponential race.

    Rows with a generator draw exactly one row of noise from it; the other rows share one draw from
    the default generator. The noise is ``-log(u)`` with ``u`` uniform in ``[0, 1)``: strictly
    positive, and ``inf`` (a token that cannot win this step) with probability about ``2**-24``.
    """
    noise = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < num_rows:
        if not seeded:
            noise.uniform_()
        else:
            unseeded = [i for i, g in enumerate(generators) if g is None]
            index = index_tensor(unseeded, device)
            shared = torch.empty(len(unseeded), vocab_size, dtype=torch.float32, device=device)
            noise.index_copy_(0, index, shared.uniform_())
    for i in seeded:
        generator = generators[i]
        assert generator is not None
        if generator.device == noise.device:
            noise[i].uniform_(generator=generator)
        else:
            draw = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
            noise[i].copy_(draw.uniform_(generator=generator), non_blocking=True)
    return noise.log_().neg_()


def inverse_cdf_sample(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``probs`` (``[rows, vocab]``, unnormalised, non-negative, each row with
    some positive mass) by inverse transform sampling: the first token whose cumulative mass exceeds
    ``u * total`` for ``u`` uniform in ``[0, 1)``.

    It draws one random number per row instead of one per vocabulary entry, which on the CPU makes it
    many times cheaper than the exponential race; a token of zero probability is never chosen. Rows
    with a generator draw their ``u`` from it alone, the others share one draw.
    """
    num_rows = probs.shape[0]
    u = torch.empty(num_rows, dtype=torch.float64)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < num_rows:
        unseeded = [i for i, g in enumerate(generators) if g is None]
        u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64)
    for i in seeded:
        generator = generators[i]
        assert generator is not None
        u[i] = torch.rand(1, dtype=torch.float64, generator=generator, device=generator.device).item()
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, so the search always lands on a token with positive probability.
    target = torch.minimum(
        u.to(probs.device, probs.dtype)[:, None] * total, torch.nextafter(total, torch.zeros_like(total))
    )
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


class Sampler:
    """Samples one token per row from last-position logits (see the module docstring for the order).

    ``top_p_candidates`` is how many of the most likely tokens top-p first looks at before falling
    back to larger candidate sets and finally a full sort (on the CPU) or to a Triton kernel over
    the whole row (elsewhere), see :func:`filter_thresholds`.
    """

    def __init__(self, top_p_candidates: int = 128) -> None:
        self.top_p_candidates = top_p_candidates

    def __call__(self, logits: torch.Tensor, batch: SamplingInputs) -> SampledTokens:
        """Sample from ``logits`` (``[len(batch), vocab]``, any float dtype); the tensor is not modified."""
        return self.sample(logits, batch).output()

    def sample(self, logits: torch.Tensor, batch: SamplingInputs) -> DeviceSamples:
        """Sample without waiting for the device: the tokens and log probabilities stay on the
        device (see :class:`DeviceSamples`), so the host may go on while the device computes them."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [num_rows, vocab], got shape {tuple(logits.shape)}.")
        num_rows = logits.shape[0]
        batch.check(num_rows)
        params = batch.params
        device = logits.device
        if num_rows == 0:
            empty = torch.empty(0, dtype=torch.int64, device=device)
            return DeviceSamples(empty, empty.float(), params)
        raw = logits.float()  # the caller's tensor when already float32: never written to

        raw_max: torch.Tensor | None = None
        if cpu_ops.usable(raw):
            raw_max, raw_argmax, raw_logsumexp = cpu_ops.max_logsumexp(raw)
        else:
            raw_logsumexp = torch.logsumexp(raw, dim=-1)
        if any(needs_logits_processing(batch, i) for i in range(num_rows)):
            processed = raw.clone()
            apply_logits_processors(processed, batch)
            owned = True
        else:
            processed = raw
            owned = False

        # A row whose constraints (allowed ids, bad words, min_tokens, a grammar) leave no token, or
        # whose processed logits are not finite (a penalty pushed one to infinity), gets token 0 on the
        # device, so a step scheduled ahead still reads a valid id, and NO_TOKEN on the host, where its
        # request ends.
        no_token = ~torch.isfinite(processed.amax(dim=-1)) if owned or batch.masked_rows else None

        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        sampled_raw: torch.Tensor | None = None
        if len(greedy_rows) == num_rows:
            if raw_max is not None and not owned:
                token_ids, sampled_raw = raw_argmax, raw_max
            else:
                # Tensor.max(dim) is cheaper than argmax on CPU and gives the raw logit when unprocessed.
                best, token_ids = processed.max(dim=-1)
                if not owned:
                    sampled_raw = best
        elif not greedy_rows:
            token_ids = self._sample_random(processed, params, batch.generators, owned)
        else:
            random_rows = [i for i, p in enumerate(params) if not p.greedy]
            greedy_index = index_tensor(greedy_rows, device)
            random_index = index_tensor(random_rows, device)
            token_ids = torch.empty(num_rows, dtype=torch.int64, device=device)
            token_ids.index_copy_(
                0, greedy_index, processed.index_select(0, greedy_index).max(dim=-1).indices
            )
            sampled = self._sample_random(
                processed.index_select(0, random_index),
                [params[i] for i in random_rows],
                [batch.generators[i] for i in random_rows],
                owned=True,
            )
            token_ids.index_copy_(0, random_index, sampled)

        if no_token is not None:
            token_ids = token_ids.masked_fill(no_token, 0)
            sampled_raw = None
        if sampled_raw is None:
            sampled_raw = raw.gather(1, token_ids[:, None]).squeeze(1)
        result = DeviceSamples(token_ids, sampled_raw - raw_logsumexp, params, no_token=no_token)
        _top_logprobs(result, raw, raw_logsumexp, sampled_raw)
        return result

    def probabilities(self, logits: torch.Tensor, batch: SamplingInputs) -> torch.Tensor:
        """The distribution :meth:`sample` draws each row's token from, as ``[rows, vocab]`` float32.

        The logits processors run first, as in :meth:`sample`. A greedy row is one-hot on the argmax
        of its processed logits; a random row is its temperature / top-k / top-p / min-p distribution
        renormalised to sum to 1 (the same tensor :meth:`sample` draws from, before the draw). A row
        whose processed logits leave no token (the rows :meth:`sample` reports as ``NO_TOKEN``) is
        all zeros. Nothing is drawn, so no generator advances; ``logits`` is not modified.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [num_rows, vocab], got shape {tuple(logits.shape)}.")
        num_rows, vocab_size = logits.shape
        batch.check(num_rows)
        params = batch.params
        device = logits.device
        raw = logits.float()
        owned = any(needs_logits_processing(batch, i) for i in range(num_rows))
        processed = raw.clone() if owned else raw
        if owned:
            apply_logits_processors(processed, batch)
        no_token = ~torch.isfinite(processed.amax(dim=-1))

        probs = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if greedy_rows:
            index = index_tensor(greedy_rows, device)
            best = processed.index_select(0, index).max(dim=-1).indices
            probs.index_put_((index, best), torch.ones(len(greedy_rows), device=device))
        if len(random_rows) == num_rows:
            probs = self._filtered_probs(processed, params, owned)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        elif random_rows:
            index = index_tensor(random_rows, device)
            filtered = self._filtered_probs(
                processed.index_select(0, index), [params[i] for i in random_rows], owned=True
            )
            probs.index_copy_(0, index, filtered / filtered.sum(dim=-1, keepdim=True))
        # Rows without a token hold NaN (softmax of all -inf) or a meaningless one-hot: zero them.
        return probs.masked_fill_(no_token[:, None], 0.0)

    def _sample_random(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        owned: bool,
    ) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then the exponential race.

        ``owned``: ``logits`` is a private copy that may be scaled in place.
        """
        probs = self._filtered_probs(logits, params, owned)
        if probs.device.type == "cpu":
            return inverse_cdf_sample(probs, generators)
        noise = exponential_noise(probs.shape[0], probs.shape[1], generators, probs.device)
        return probs.div_(noise).max(dim=-1).indices

    def _filtered_probs(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], owned: bool
    ) -> torch.Tensor:
        """Temperature, softmax, then top-k, top-p and min-p: the distribution a random row is drawn
        from, with the filtered tokens set to 0 and the rest not renormalised."""
        num_rows, vocab_size = logits.shape
        device = logits.device
        temperatures = [p.temperature for p in params]
        if any(t != 1.0 for t in temperatures):
            scale = device_tensor(temperatures, logits.dtype, device)[:, None]
            logits = logits.div_(scale) if owned else logits / scale
        probs = logits.softmax(dim=-1)

        # top-k, top-p and min-p all keep the tokens at least as likely as a per-row threshold.
        thresholds: torch.Tensor | None = None
        filter_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab_size or p.top_p < 1.0]
        if filter_rows:
            top_k = [params[i].top_k for i in filter_rows]
            top_p = [params[i].top_p for i in filter_rows]
            if len(filter_rows) == num_rows:
                thresholds = filter_thresholds(probs, top_k, top_p, self.top_p_candidates)
            else:
                index = index_tensor(filter_rows, device)
                rows_thresholds = filter_thresholds(
                    probs.index_select(0, index), top_k, top_p, self.top_p_candidates
                )
                thresholds = probs.new_zeros(num_rows).index_copy_(0, index, rows_thresholds)
        min_ps = [p.min_p for p in params]
        if any(m > 0.0 for m in min_ps):
            # Relative to the most likely token, so the top-k / top-p renormalisation does not matter.
            min_p = device_tensor(min_ps, probs.dtype, device)
            min_p_thresholds = probs.amax(dim=-1) * min_p
            thresholds = (
                min_p_thresholds if thresholds is None else torch.maximum(thresholds, min_p_thresholds)
            )
        if thresholds is not None:
            probs.masked_fill_(probs < thresholds[:, None], 0.0)
        return probs


def _top_logprobs(
    result: DeviceSamples, raw: torch.Tensor, raw_logsumexp: torch.Tensor, sampled_raw: torch.Tensor
) -> None:
    """Rank of the sampled token and the top ``params[i].logprobs`` tokens of each requesting row,
    computed on the device into ``result``."""
    params = result.params
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return
    vocab_size = raw.shape[-1]
    index = None if len(rows) == len(params) else index_tensor(rows, raw.device)
    sub = raw if index is None else raw.index_select(0, index)
    sub_sampled = sampled_raw if index is None else sampled_raw.index_select(0, index)
    result.logprob_rows = rows
    result.ranks = (sub > sub_sampled[:, None]).sum(dim=-1) + 1
    max_k = min(max(params[i].logprobs or 0 for i in rows), vocab_size)
    if max_k > 0:
        values, result.top_ids = sub.topk(max_k, dim=-1)
        sub_lse = raw_logsumexp if index is None else raw_logsumexp.index_select(0, index)
        result.top_logprobs = values - sub_lse[:, None]
