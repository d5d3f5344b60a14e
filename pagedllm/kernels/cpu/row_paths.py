"""Which rows of a step's quantized products are prompt rows: the per-step choice of product path.

The quantized products (:mod:`pagedllm.kernels.cpu.quant`) have two paths that round differently: the
integer kernels (activations quantized to int8) and, where the CPU has AMX, the bfloat16 tiles. On
each path a row's result depends only on that row (not on how many rows the product has, nor where the
row lies in it), so a token computes the same bits in any batch as long as its path is chosen by the
token alone. The rule: a prompt token (a position below its request's prompt length, whether its chunk
has one row or a thousand, recomputed after preemption or not) takes the tiles; every other row (a
decode row, a draft being verified, an output token recomputed after preemption) takes the integer
kernels.

The model runner marks its rows with :func:`prompt_rows` around a forward (and around each LM-head
product of selected rows); :class:`~pagedllm.kernels.cpu.quant_linear.QuantLinear` reads the mark with
:func:`current_split` and runs one product per path. Without a mark, every row takes the integer
kernels. The mark is a :class:`contextvars.ContextVar`, so it belongs to the thread (or task) that set
it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from pagedllm.kernels.cpu.quant import amx_enabled


@dataclasses.dataclass(frozen=True)
class RowSplit:
    """The rows of a product split by path: ``prompt`` rows take the AMX tiles, ``other`` rows the
    integer kernels. Each is ``None`` (no such row), a ``slice`` (one contiguous run) or an int64
    index tensor (several runs), in ascending order; together they are the ``num_rows`` rows."""

    num_rows: int
    prompt: slice | torch.Tensor | None
    other: slice | torch.Tensor | None

    @classmethod
    def from_mask(cls, mask: Sequence[bool] | np.ndarray) -> RowSplit:
        """The split of ``mask`` (True: a prompt row) where the tiles run here (:func:`amx_enabled`);
        elsewhere every row is an ``other`` row."""
        flags = np.asarray(mask, dtype=bool).reshape(-1)
        n = int(flags.shape[0])
        if not amx_enabled():
            flags = np.zeros(n, dtype=bool)
        return cls(n, _rows(np.flatnonzero(flags)), _rows(np.flatnonzero(~flags)))


def _rows(index: np.ndarray) -> slice | torch.Tensor | None:
    if index.size == 0:
        return None
    first, last = int(index[0]), int(index[-1])
    if last - first + 1 == index.size:
        return slice(first, last + 1)
    return torch.from_numpy(index.astype(np.int64))


_CURRENT: contextvars.ContextVar[RowSplit | None] = contextvars.ContextVar(
    "pagedllm_prompt_rows", default=None
)


def current_split() -> RowSplit | None:
    """The split set by the innermost :func:`prompt_rows` of this thread, or None (no mark: every row
    takes the integer kernels)."""
    return _CURRENT.get()


@contextlib.contextmanager
def prompt_rows(mask: Sequence[bool] | np.ndarray | RowSplit) -> Iterator[RowSplit]:
    """Within the block, quantized products of ``len(mask)`` rows take the AMX tiles for the rows
    where ``mask`` is True (prompt tokens) and the integer kernels for the others. A quantized product
    of any other row count inside the block is an error (its rows would not be the marked ones)."""
    split = mask if isinstance(mask, RowSplit) else RowSplit.from_mask(mask)
    token = _CURRENT.set(split)
    try:
        yield split
    finally:
        _CURRENT.reset(token)
