"""Logits processors: the per-request constraints applied to a step's logits before sampling.

One function per processor, applied in this order by :func:`apply_logits_processors` (vLLM v1's):

1. :func:`apply_penalty_processor`: repetition / frequency / presence penalties;
2. :func:`apply_logit_bias`: ``logit_bias`` added to its tokens;
3. :func:`apply_allowed_token_ids`: every token outside ``allowed_token_ids`` masked;
4. :func:`apply_bad_words`: the last token of a banned sequence masked when the output ends with its
   prefix;
5. :func:`apply_min_tokens`: EOS and stop token ids masked until ``min_tokens`` were generated.

Each works on the float ``[len(batch), vocab]`` logits in place and touches only the rows that use it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedllm.sample.penalties import apply_penalties, device_tensor, flatten_token_ids
from pagedllm.sample.sampling_inputs import SamplingInputs
from pagedllm.sampling_params import SamplingParams

_NEG_INF = float("-inf")


def _has_min_tokens_ban(params: SamplingParams, num_output: int, eos_token_ids: Sequence[int]) -> bool:
    if num_output >= params.min_tokens:
        return False
    return bool(
        params.stop_token_ids or params.all_stop_token_ids or (eos_token_ids and not params.ignore_eos)
    )


def needs_logits_processing(batch: SamplingInputs, i: int) -> bool:
    """Whether any processor changes row ``i`` (rows that need none skip the whole step)."""
    p = batch.params[i]
    return bool(
        p.repetition_penalty != 1.0
        or p.frequency_penalty != 0.0
        or p.presence_penalty != 0.0
        or p.logit_bias
        or p.allowed_token_ids is not None
        or (batch.bad_words_token_ids is not None and batch.bad_words_token_ids[i])
        or _has_min_tokens_ban(p, len(batch.output_token_ids[i]), batch.eos_token_ids)
    )


def index_tensor(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """Row (or token) indices as an int64 tensor on ``device``."""
    return device_tensor(rows, torch.int64, device)


def apply_logits_processors(logits: torch.Tensor, batch: SamplingInputs) -> None:
    """Apply every processor in order, in place. Temperature and the top-k / top-p / min-p filters
    are not part of this step."""
    apply_penalty_processor(logits, batch)
    apply_logit_bias(logits, batch)
    apply_allowed_token_ids(logits, batch)
    apply_bad_words(logits, batch)
    apply_min_tokens(logits, batch)


def apply_penalty_processor(logits: torch.Tensor, batch: SamplingInputs) -> None:
    """Repetition, frequency and presence penalties, on the rows that use any."""
    params = batch.params
    rows = [
        i
        for i, p in enumerate(params)
        if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    ]
    if not rows:
        return
    all_rows = len(rows) == logits.shape[0]
    index = index_tensor(rows, logits.device)
    sub = logits if all_rows else logits.index_select(0, index)
    apply_penalties(
        sub,
        [batch.prompt_token_ids[i] for i in rows],
        [batch.output_token_ids[i] for i in rows],
        [params[i].repetition_penalty for i in rows],
        [params[i].frequency_penalty for i in rows],
        [params[i].presence_penalty for i in rows],
    )
    if not all_rows:
        logits.index_copy_(0, index, sub)


def apply_logit_bias(logits: torch.Tensor, batch: SamplingInputs) -> None:
    """``logit_bias``: one accumulating ``index_put_`` over all (row, token, bias) triples."""
    rows: list[int] = []
    tokens: list[int] = []
    values: list[float] = []
    for i, p in enumerate(batch.params):
        if p.logit_bias:
            rows.extend([i] * len(p.logit_bias))
            tokens.extend(p.logit_bias.keys())
            values.extend(p.logit_bias.values())
    if rows:
        device = logits.device
        bias = device_tensor(values, logits.dtype, device)
        logits.index_put_((index_tensor(rows, device), index_tensor(tokens, device)), bias, accumulate=True)


def apply_allowed_token_ids(logits: torch.Tensor, batch: SamplingInputs) -> None:
    """``allowed_token_ids``: every other token of the row masked."""
    params = batch.params
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not rows:
        return
    num_rows, vocab_size = logits.shape
    device = logits.device
    allowed: list[list[int]] = [params[i].allowed_token_ids or [] for i in rows]
    mask_rows, mask_cols = flatten_token_ids(allowed, device)
    banned = torch.ones(len(rows), vocab_size, dtype=torch.bool, device=device)
    banned[mask_rows, mask_cols] = False
    if len(rows) == num_rows:
        logits.masked_fill_(banned, _NEG_INF)
    else:
        index = index_tensor(rows, device)
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(banned, _NEG_INF))


def apply_bad_words(logits: torch.Tensor, batch: SamplingInputs) -> None:
    """``bad_words``: the last token of each banned sequence whose prefix ends the output, masked."""
    if batch.bad_words_token_ids is None:
        return
    vocab_size = logits.shape[1]
    rows: list[int] = []
    tokens: list[int] = []
    for i, words in enumerate(batch.bad_words_token_ids):
        if not words:
            continue
        output = batch.output_token_ids[i]
        for word in words:
            if not word or not 0 <= word[-1] < vocab_size:
                continue
            prefix_len = len(word) - 1
            if prefix_len == 0 or (
                len(output) >= prefix_len and output[len(output) - prefix_len :] == word[:prefix_len]
            ):
                rows.append(i)
                tokens.append(word[-1])
    _mask(logits, rows, tokens)


def apply_min_tokens(logits: torch.Tensor, batch: SamplingInputs) -> None:
    """``min_tokens``: stop token ids (and EOS unless ``ignore_eos``) masked while the output is short."""
    vocab_size = logits.shape[1]
    rows: list[int] = []
    tokens: list[int] = []
    for i, p in enumerate(batch.params):
        if _has_min_tokens_ban(p, len(batch.output_token_ids[i]), batch.eos_token_ids):
            stop_ids = set(p.stop_token_ids or ()) | p.all_stop_token_ids
            if not p.ignore_eos:
                stop_ids.update(batch.eos_token_ids)
            stop_ids = {t for t in stop_ids if 0 <= t < vocab_size}
            rows.extend([i] * len(stop_ids))
            tokens.extend(stop_ids)
    _mask(logits, rows, tokens)


def _mask(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> None:
    """Set ``logits[rows[j], tokens[j]]`` to -inf for every j."""
    if rows:
        device = logits.device
        logits.index_put_(
            (index_tensor(rows, device), index_tensor(tokens, device)), logits.new_full((), _NEG_INF)
        )
