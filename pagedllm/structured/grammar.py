"""Per-sequence grammar state and the batched token bitmask applied to the logits."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import xgrammar as xgr

from pagedllm.kernels.cpu import ops as cpu_ops
from pagedllm.request import GrammarState


class XGrammarState:
    """The xgrammar matcher of one constrained sequence.

    It is advanced with every output token. Once the grammar has matched completely, the only token it
    allows is a stop token (the model's EOS); accepting that token terminates the matcher.
    """

    __slots__ = ("matcher",)

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar does not allow it."""
        return bool(self.matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The grammar matched completely and a stop token was accepted after it."""
        return bool(self.matcher.is_terminated())

    @property
    def is_completed(self) -> bool:
        """The output so far is a complete match (a stop token would be accepted now)."""
        return bool(self.matcher.is_completed())

    @property
    def is_active(self) -> bool:
        """Always: a plain grammar constrains every token (see :class:`pagedllm.request.GatedGrammar`)."""
        return True


@functools.cache
def _batch_matcher() -> xgr.BatchGrammarMatcher:
    return xgr.BatchGrammarMatcher()


def apply_grammar_bitmask(logits: torch.Tensor, grammars: Sequence[GrammarState | None]) -> None:
    """Set to ``-inf`` the logits of every token the row's grammar does not allow, in place.

    ``logits`` is the float32 ``[num_rows, vocab]`` tensor of the batch and ``grammars[i]`` the state of
    row ``i`` (None: the row is unconstrained and left untouched). One bitmask is filled for the whole
    batch and applied with xgrammar's kernel (its CPU implementation for CPU logits).
    """
    if logits.dim() != 2 or logits.shape[0] != len(grammars):
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not match a batch of {len(grammars)} rows."
        )
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    num_rows, vocab_size = logits.shape
    matchers = [g.matcher for g in grammars if g is not None]
    bitmask = xgr.allocate_token_bitmask(num_rows, vocab_size)
    _batch_matcher().batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
    if cpu_ops.usable(logits) and logits.stride(1) == 1:
        cpu_ops.apply_token_bitmask(logits, bitmask, rows)  # several times faster than xgrammar's CPU kernel
        return
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=rows)
