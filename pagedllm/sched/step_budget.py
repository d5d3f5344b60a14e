"""The step-time budget: how many prompt tokens a step may compute so that it stays under a target.

A step's time is modelled from its shape (:class:`StepShape`) as

    seconds ~= a + b * tokens + c * rows + d * pairs + e * prefill_rows + f * prefill_context

where ``tokens`` are the step's query tokens (a decode row's one token, a prefill chunk's length,
draft tokens), ``rows`` its requests, ``pairs`` its attention (query, key) pairs, ``prefill_rows``
its prefill chunks and ``prefill_context`` the cached tokens those chunks read. A chunk of ``n``
tokens starting at position ``s`` attends to ``n * s + n * (n + 1) / 2`` keys, so a chunk deep into
a long prompt costs more per token than the prompt's first one (on a CPU, 8k tokens deep, ten
times more); it also reads the ``s`` cached tokens' K/V whatever its length, so that deep into a
prompt a small chunk is dear per token; and a step with a chunk leaves the decode-only fast path,
which ``e`` prices.
:class:`StepCostModel` fits the coefficients online from the engine's own measured step times;
:class:`StepBudget` turns the fit into the largest prefill chunk that keeps a step's predicted time
under its limit: the target, or, where the step's overhead (everything but its prompt tokens) is
already most of the target, ``1 / (1 - MIN_PREFILL_SHARE)`` times that overhead up to
``MAX_STRETCH`` targets, so that prompt tokens take a fair share of a step that computes them: deep
into a long prompt, beside a large decode batch, or on a machine where every step waits for
descheduled threads, steps lengthen a little instead of prompts crawling a block a step. (Unbounded,
a fit from a few small steps that took a per-token cost for a per-chunk one stretched steps to five
targets.)

Invariants:

- The coefficients are never negative (a non-negative least-squares fit): adding work to a step
  never makes its predicted time smaller, so the chunk limit is found by bisection.
- The fit is robust on a busy machine: it minimises the steps' absolute relative errors (a median
  regression, by reweighted least squares), so a 5 ms decode step counts as much as a 2 s prefill
  and a minority of steps slowed by another process moves it little; it predicts a step's typical
  time. It keeps the latest few steps of each kind of shape (the magnitudes of its chunks, their
  tokens and context, its attention pairs and rows), so a long run of one kind (decodes, or the small chunks
  deep into a long prompt) does not push out what the others measured and leave the coefficients
  undetermined. Where the linear fit strays (deep into a long prompt, attention per pair grows dearer
  as the cached K/V outgrow the processor's caches), the median measured-to-fitted ratio of the
  latest few steps of the same sort corrects it.
- Until the model has measured prefill at two sizes, and always after, a step's prefill is at most
  twice the largest prefill measured in a step (``initial_tokens`` before any), so the budget ramps
  up from measurements and never extrapolates far beyond them; beyond the largest prefill measured,
  a step is predicted to cost at least that step's time per prompt token. After ``PROBE_AFTER`` steps in a row
  of one prefill size with the prompt held to one block, one step probes two blocks: steps of one
  size cannot tell a per-token cost from a per-chunk one, and without the probe a fit that took one
  for the other would never see otherwise.
- :meth:`StepBudget.chunk_limit` never exceeds the token budget it is given
  (``max_num_batched_tokens`` stays an upper bound), and the step's first prefill chunk gets at
  least one block (``block_size`` tokens, or the prompt's rest when shorter), whatever the
  prediction, so that a waiting prompt always progresses. Beyond that floor, a chunk that does not
  finish its prompt ends on a block boundary, so the blocks it fills enter the prefix cache at once.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

SAMPLES_PER_KIND = 6  # the latest steps kept per kind of shape
MAX_SAMPLES = 128  # steps kept in all (the oldest leave first)
RECENT = 5  # the latest steps whose measured-to-fitted ratio corrects a prediction
PROBE_AFTER = 6  # steps in a row of one prefill size at one block, after which a step probes two
MAX_CORRECTION = 4.0  # ... by a factor within [1/4, 4]
MEDIAN_ITERATIONS = 6  # reweighted least-squares passes of the median regression
MIN_RESIDUAL = 0.02  # relative errors below this weigh as this (the reweighting stays bounded)
MIN_PREFILL_SHARE = 0.5  # of a step with prefill, the least predicted time its prompt tokens get
MAX_STRETCH = 1.25  # ... but a step is stretched for that to at most this many targets


@dataclass(frozen=True)
class StepShape:
    """What a step computes: its requests (rows), query tokens, attention (query, key) pairs, and
    its prefill chunks (rows computing more than one known token), their tokens and pairs."""

    rows: int = 0
    tokens: int = 0
    pairs: float = 0.0
    prefill_rows: int = 0
    prefill_tokens: int = 0
    prefill_pairs: float = 0.0
    prefill_context: int = 0  # cached tokens the prefill chunks read

    def plus(
        self, start: int, num_tokens: int, num_drafts: int = 0, prefill: bool | None = None
    ) -> StepShape:
        """This shape with one more row computing ``num_tokens`` tokens from position ``start``, the
        last ``num_drafts`` of them draft tokens. The row is a prefill chunk when it computes more
        than one known token (a decode verifying drafts is none), unless ``prefill`` says."""
        pairs = num_tokens * start + num_tokens * (num_tokens + 1) / 2
        chunk = num_tokens - num_drafts > 1 if prefill is None else prefill
        return StepShape(
            self.rows + 1,
            self.tokens + num_tokens,
            self.pairs + pairs,
            self.prefill_rows + chunk,
            self.prefill_tokens + (num_tokens if chunk else 0),
            self.prefill_pairs + (pairs if chunk else 0.0),
            self.prefill_context + (start if chunk else 0),
        )

    def __add__(self, other: StepShape) -> StepShape:
        return StepShape(
            self.rows + other.rows,
            self.tokens + other.tokens,
            self.pairs + other.pairs,
            self.prefill_rows + other.prefill_rows,
            self.prefill_tokens + other.prefill_tokens,
            self.prefill_pairs + other.prefill_pairs,
            self.prefill_context + other.prefill_context,
        )

    def overhead(self) -> StepShape:
        """This step without its prompt tokens: its decode rows, and its chunks as empty rows (that
        still read their cached tokens)."""
        return StepShape(
            self.rows,
            self.tokens - self.prefill_tokens,
            self.pairs - self.prefill_pairs,
            self.prefill_rows,
            prefill_context=self.prefill_context,
        )

    def features(self) -> tuple[float, ...]:
        return (
            1.0,
            float(self.tokens),
            float(self.rows),
            self.pairs,
            float(self.prefill_rows),
            float(self.prefill_context),
        )


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares of ``x @ w ~= y`` (Lawson and Hanson's active-set method): columns
    enter the fit while they would lower the error with a positive coefficient; a column whose
    coefficient would turn negative leaves it."""
    cols = x.shape[1]
    w = np.zeros(cols)
    free = np.zeros(cols, dtype=bool)  # the columns in the fit
    tol = 1e-10 * max(1.0, float(np.abs(x).sum(axis=0).max())) * max(x.shape)
    for _ in range(3 * cols):
        gradient = x.T @ (y - x @ w)
        if free.all() or gradient[~free].max() <= tol:
            break
        free[np.argmax(np.where(free, -np.inf, gradient))] = True
        while True:
            z = np.zeros(cols)
            z[free] = np.linalg.lstsq(x[:, free], y, rcond=None)[0]
            if np.all(z[free] > 0):
                w = z
                break
            leaving = free & (z <= 0)
            alpha = float(np.min(w[leaving] / (w[leaving] - z[leaving])))
            w = w + alpha * (z - w)
            free &= w > tol
            w[~free] = 0.0
    return w


class _Samples:
    """Measured steps: the latest ``per_kind`` of each kind of shape, at most ``limit`` in all."""

    def __init__(self, per_kind: int, limit: int) -> None:
        self.per_kind, self.limit = per_kind, limit
        self._kinds: dict[tuple[int, ...], deque[tuple[int, StepShape, float]]] = {}
        self._order = itertools.count()
        self._size = 0

    @staticmethod
    def kind(shape: StepShape) -> tuple[int, ...]:
        return (
            shape.prefill_rows.bit_length(),
            shape.prefill_tokens.bit_length(),
            shape.prefill_context.bit_length(),
            int(shape.pairs).bit_length(),
            shape.rows.bit_length(),
        )

    def add(self, shape: StepShape, seconds: float) -> None:
        kept = self._kinds.setdefault(self.kind(shape), deque())
        kept.append((next(self._order), shape, seconds))
        self._size += 1
        if len(kept) > self.per_kind:
            kept.popleft()
            self._size -= 1
        elif self._size > self.limit:
            oldest = min(self._kinds, key=lambda k: self._kinds[k][0][0])
            self._kinds[oldest].popleft()
            self._size -= 1
            if not self._kinds[oldest]:
                del self._kinds[oldest]

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[tuple[StepShape, float]]:
        for kept in self._kinds.values():
            for _, shape, seconds in kept:
                yield shape, seconds


class StepCostModel:
    """Step time as a non-negative linear function of a step's shape, fitted from measured steps.

    ``predict`` is None until the samples determine the prefill cost: steps with prefill of two
    different sizes. The fit is recomputed lazily, after new samples, when a prediction is asked."""

    def __init__(self, per_kind: int = SAMPLES_PER_KIND, limit: int = MAX_SAMPLES) -> None:
        self._samples = _Samples(per_kind, limit)
        # Measured over fitted time of the latest steps without prefill (False) and with (True).
        self._ratios: dict[bool, deque[float]] = {False: deque(maxlen=RECENT), True: deque(maxlen=RECENT)}
        self._coef: np.ndarray | None = None
        self._stale = False

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Record a measured step (a non-positive or non-finite time is not a measurement)."""
        if not (seconds > 0 and math.isfinite(seconds)) or shape.rows <= 0:
            return
        if self._coef is not None:  # the latest fit (refitting is left to the next prediction)
            fitted = float(np.dot(self._coef, shape.features()))
            if fitted > 0:
                self._ratios[shape.prefill_rows > 0].append(seconds / fitted)
        self._samples.add(shape, seconds)
        self._stale = True

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    @property
    def coefficients(self) -> tuple[float, ...] | None:
        """``(a, b, c, d, e, f)``: seconds per step, per token, per row, per attention pair, per
        prefill chunk and per cached token a chunk reads (None until determined)."""
        coef = self._fitted()
        return None if coef is None else tuple(float(c) for c in coef)

    def predict(self, shape: StepShape) -> float | None:
        """The fit's time for ``shape``, times the median ratio of measured to fitted time over the
        latest steps of its sort (with prefill or without): the recent steps, alike (the chunks of
        one long prompt), correct what a linear fit misses where it strays from its average."""
        fitted = self._linear(shape)
        if fitted is None:
            return None
        ratios = self._ratios[shape.prefill_rows > 0]
        correction = statistics.median(ratios) if ratios else 1.0
        return fitted * min(max(correction, 1 / MAX_CORRECTION), MAX_CORRECTION)

    def _linear(self, shape: StepShape) -> float | None:
        coef = self._fitted()
        return None if coef is None else float(np.dot(coef, shape.features()))

    def _fitted(self) -> np.ndarray | None:
        if self._stale:
            self._stale = False
            self._coef = self._fit()
        return self._coef

    def _fit(self) -> np.ndarray | None:
        samples = list(self._samples)
        if len({s.prefill_tokens for s, _ in samples if s.prefill_rows}) < 2:
            return None
        x = np.array([s.features() for s, _ in samples], dtype=np.float64)
        y = np.array([t for _, t in samples], dtype=np.float64)
        # Relative error: each row divided by its measured time; columns scaled to [0, 1].
        x /= y[:, None]
        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0
        x /= scale
        ones = np.ones_like(y)
        w = _nnls(x, ones)
        for _ in range(MEDIAN_ITERATIONS):  # least absolute relative error: weights 1 / |residual|
            root = 1.0 / np.sqrt(np.maximum(np.abs(x @ w - ones), MIN_RESIDUAL))
            w = _nnls(x * root[:, None], root)
        return w / scale


class StepBudget:
    """The prefill budget of a step: chunks sized so the step's predicted time stays under
    ``target_s`` (see the module docstring for the limit and the invariants)."""

    def __init__(
        self,
        target_s: float,
        block_size: int,
        model: StepCostModel | None = None,
        initial_tokens: int | None = None,
    ) -> None:
        if not target_s > 0:
            raise ValueError(f"the step-time target must be positive, got {target_s}.")
        self.target_s = target_s
        self.block_size = block_size
        self.model = model or StepCostModel()
        self.initial_tokens = initial_tokens or 4 * block_size
        self.largest_prefill = 0  # the most prefill tokens of a measured step
        self.largest_prefill_s = 0.0  # ... and that step's time
        self._last_prefill = 0  # the prefill tokens of the latest measured step with prefill
        self._same_prefill = 0  # ... and how many steps in a row had that many
        self.probes = 0  # steps that probed a larger chunk (see PROBE_AFTER)

    def observe(self, shape: StepShape, seconds: float) -> None:
        self.model.observe(shape, seconds)
        if shape.prefill_tokens >= self.largest_prefill and shape.prefill_tokens:
            self.largest_prefill, self.largest_prefill_s = shape.prefill_tokens, seconds
        if shape.prefill_rows:
            same = shape.prefill_tokens == self._last_prefill
            self._same_prefill = self._same_prefill + 1 if same else 1
            self._last_prefill = shape.prefill_tokens

    @property
    def ramp_tokens(self) -> int:
        """The most prefill tokens a step may hold now: twice the most measured."""
        return max(self.initial_tokens, 2 * self.largest_prefill)

    def step_limit(self, shape: StepShape, start: int) -> float | None:
        """The predicted time a step of ``shape`` plus a chunk from ``start`` may take: the target, or
        more where the step's overhead (its time without prompt tokens) would leave its prompt tokens
        less than ``MIN_PREFILL_SHARE`` of it, up to ``MAX_STRETCH`` targets (None until the model is
        fitted)."""
        overhead = self.model.predict(shape.plus(start, 0, prefill=True).overhead())
        if overhead is None:
            return None
        return max(self.target_s, min(overhead / (1 - MIN_PREFILL_SHARE), MAX_STRETCH * self.target_s))

    def chunk_limit(self, shape: StepShape, start: int, remaining: int, budget: int) -> int:
        """The tokens a row starting at position ``start`` (with ``remaining`` tokens to compute) may
        compute in a step whose rows so far make ``shape``, under a token budget of ``budget``: at
        most ``min(remaining, budget)``, at least one block when the step has no prefill yet (0 means
        no room left); beyond that floor, a chunk that does not finish the prompt ends on a block
        boundary."""
        most = min(remaining, budget, max(0, self.ramp_tokens - shape.prefill_tokens))
        limit = self.step_limit(shape, start)
        if limit is not None:
            most = self._largest_within(shape, start, most, limit)
        if most < remaining:  # a partial chunk ends on a block boundary
            most = max(0, (start + most) // self.block_size * self.block_size - start)
        if not shape.prefill_rows:  # the step's first chunk
            most = max(most, min(remaining, budget, self.block_size))
            if (
                limit is not None
                and self._same_prefill >= PROBE_AFTER
                and most <= self.block_size < remaining
            ):
                # A prompt held to one block a step: steps of one prefill size cannot tell a per-token
                # cost from a per-chunk one, so probe two blocks once (within the token budget).
                most = min(2 * most, remaining, budget, max(most, self.ramp_tokens))
                self._same_prefill = 0
                self.probes += 1
        return most

    def _largest_within(self, shape: StepShape, start: int, most: int, limit: float) -> int:
        """The largest ``n <= most`` whose step is predicted within ``limit`` seconds (0 if none)."""

        def within(n: int) -> bool:
            step = shape.plus(start, n, prefill=True)
            predicted = self.model.predict(step)
            if predicted is not None and step.prefill_tokens > self.largest_prefill > 0:
                # Beyond the largest prefill measured, no cheaper per prompt token than it was: a fit
                # from a few small steps may take a cost that grows with the chunks for a fixed one.
                predicted = max(
                    predicted, self.largest_prefill_s * step.prefill_tokens / self.largest_prefill
                )
            return predicted is not None and predicted <= limit

        if within(most):
            return most
        lo, hi = 0, most
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if within(mid):
                lo = mid
            else:
                hi = mid
        return lo
