"""Repetition, frequency and presence penalties, applied to a batch of logits with tensor ops, and
the non-blocking host-to-device copy of per-row values the sampler shares."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch


def device_tensor(
    values: Sequence[float] | Sequence[int], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A tensor of host ``values`` on ``device``, copied without blocking the host: the copy is staged
    at once and queued behind the device's work, so sampling can be queued while the device is
    still busy with an earlier step."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def flatten_token_ids(
    token_ids: Sequence[Sequence[int]], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn ragged per-row token lists into flat ``(row, token)`` index tensors on ``device``.

    Row ``i`` of ``token_ids`` contributes ``len(token_ids[i])`` entries with row index ``i``.
    """
    lengths = [len(ids) for ids in token_ids]
    total = sum(lengths)
    cols = torch.from_numpy(np.fromiter(chain.from_iterable(token_ids), dtype=np.int64, count=total))
    rows = torch.repeat_interleave(
        torch.arange(len(lengths), dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64)
    )
    return rows.to(device, non_blocking=True), cols.to(device, non_blocking=True)


def token_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """Count how often each token occurs in each row: a ``[len(token_ids), vocab_size]`` float32 tensor.

    The counts are built with one ``scatter_add_`` into the flattened count tensor; ids outside
    ``[0, vocab_size)`` are ignored (they can never be sampled, so there is nothing to penalise).
    """
    num_rows = len(token_ids)
    rows, cols = flatten_token_ids(token_ids, device)
    counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=device)
    if cols.numel():
        # Out-of-vocabulary ids add 0 at index 0 (no boolean indexing: it would wait for the device).
        in_vocab = (cols >= 0) & (cols < vocab_size)
        flat = torch.where(in_vocab, rows * vocab_size + cols, 0)
        counts.scatter_add_(0, flat, in_vocab.to(torch.float32))
    return counts.view(num_rows, vocab_size)


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalties: Sequence[float],
    frequency_penalties: Sequence[float],
    presence_penalties: Sequence[float],
) -> None:
    """Apply the sampling penalties to ``logits`` (``[num_rows, vocab]``, float) in place.

    * repetition penalty (HF / vLLM semantics) over tokens seen in the prompt or the output: positive
      logits are divided by the penalty, negative ones multiplied by it;
    * frequency penalty: subtract ``penalty * count`` for each token generated so far;
    * presence penalty: subtract ``penalty`` once for each token generated so far.

    Every argument has one entry per row of ``logits``; a neutral value (1, 0, 0) leaves the row as is.
    """
    num_rows, vocab_size = logits.shape
    device = logits.device
    use_repetition = any(p != 1.0 for p in repetition_penalties)
    use_frequency = any(p != 0.0 for p in frequency_penalties)
    use_presence = any(p != 0.0 for p in presence_penalties)
    if not (use_repetition or use_frequency or use_presence):
        return

    output_counts = token_counts(output_token_ids, vocab_size, device)
    if use_repetition:
        seen = output_counts > 0
        prompt_counts = token_counts(prompt_token_ids, vocab_size, device)
        seen |= prompt_counts > 0
        repetition = device_tensor(repetition_penalties, logits.dtype, device)[:, None]
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits.copy_(torch.where(seen, penalised, logits))
    if use_frequency:
        frequency = device_tensor(frequency_penalties, logits.dtype, device)[:, None]
        logits.sub_(frequency * output_counts)
    if use_presence:
        presence = device_tensor(presence_penalties, logits.dtype, device)[:, None]
        logits.sub_(presence * (output_counts > 0).to(logits.dtype))
