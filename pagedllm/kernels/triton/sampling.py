"""Exact top-k / top-p thresholds on the device, for the rows a candidate window did not settle.

:func:`pagedllm.sample.sampler.filter_thresholds` first looks at each row's most likely tokens only.
A row whose top-p nucleus (or top-k set) reaches past them needs the whole row. On the CPU the
sampler finds those rows by reading a flag back and retries them; on a GPU that read would make the
host wait for the step's forward, so :func:`settle_thresholds` runs one Triton program per row
instead, and each program decides on the device whether its row needs work (a settled row returns at
once).

An unsettled row's threshold is found by searching the float32 bit patterns, whose integer order is
the order of non-negative floats: the ``k``-th largest probability is the largest ``t`` with
``count(probs >= t) >= k``, and the top-p threshold the largest ``t`` with
``sum(probs >= t) >= top_p * mass``, which are values of the row. Each pass over the row tests
``NUM_PROBES`` evenly spaced candidates at once, narrowing the interval ``NUM_PROBES + 1``-fold, so
about 14 passes settle a 31-bit search. The sums run in a fixed order (deterministic), but not in
the sorted order of the CPU path, so at a boundary within float rounding the two may keep one token
more or less.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.launch import launch

# The bit pattern of +inf plus one: an exclusive upper bound for every non-negative float32.
_BITS_END = 0x7F800001


@triton.jit
def _largest_passing(
    row_ptr,
    vocab_size,
    target,
    BY_COUNT: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_PROBES: tl.constexpr,
    BITS_END: tl.constexpr,
):
    """The largest non-negative float ``t`` with ``count(x >= t) >= target`` (``BY_COUNT``) or
    ``sum(x[x >= t]) >= target``; 0.0 when no ``t > 0`` passes."""
    offs = tl.arange(0, BLOCK)
    steps = tl.arange(1, NUM_PROBES + 1).to(tl.int64)
    lo = tl.full((), 0, tl.int64)  # passes (or is 0)
    hi = tl.full((), BITS_END, tl.int64)  # fails
    while hi - lo > 1:
        probes = lo + (steps * (hi - lo)) // (NUM_PROBES + 1)
        probe_values = probes.to(tl.int32).to(tl.float32, bitcast=True)
        totals = tl.zeros((NUM_PROBES,), tl.float32)
        for start in range(0, vocab_size, BLOCK):
            idx = start + offs
            x = tl.load(row_ptr + idx, mask=idx < vocab_size, other=-1.0)
            above = x[:, None] >= probe_values[None, :]
            if BY_COUNT:
                totals += tl.sum(above.to(tl.float32), axis=0)
            else:
                totals += tl.sum(tl.where(above, x[:, None], 0.0), axis=0)
        passing = totals >= target
        lo = tl.max(tl.where(passing, probes, lo), axis=0)
        hi = tl.min(tl.where(passing, hi, probes), axis=0)
    return lo.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _settle_thresholds_kernel(
    probs_ptr,
    stride_row,
    vocab_size,
    top_k_ptr,
    top_p_ptr,
    settled_ptr,
    thresholds_ptr,
    BLOCK: tl.constexpr,
    NUM_PROBES: tl.constexpr,
    BITS_END: tl.constexpr,
):
    row = tl.program_id(0)
    if tl.load(settled_ptr + row) == 0:
        row_ptr = probs_ptr + row.to(tl.int64) * stride_row
        k = tl.load(top_k_ptr + row)
        p = tl.load(top_p_ptr + row)
        offs = tl.arange(0, BLOCK)
        kth = 0.0
        if k < vocab_size:
            kth = _largest_passing(row_ptr, vocab_size, k.to(tl.float32), True, BLOCK, NUM_PROBES, BITS_END)
            # The mass of exactly k tokens: everything above the k-th value, plus ties up to k.
            above_sum = tl.zeros((BLOCK,), tl.float32)
            above_count = tl.zeros((BLOCK,), tl.float32)
            for start in range(0, vocab_size, BLOCK):
                idx = start + offs
                x = tl.load(row_ptr + idx, mask=idx < vocab_size, other=-1.0)
                above = x > kth
                above_sum += tl.where(above, x, 0.0)
                above_count += above.to(tl.float32)
            mass = tl.sum(above_sum, axis=0) + (k.to(tl.float32) - tl.sum(above_count, axis=0)) * kth
        else:
            row_sum = tl.zeros((BLOCK,), tl.float32)
            for start in range(0, vocab_size, BLOCK):
                idx = start + offs
                row_sum += tl.load(row_ptr + idx, mask=idx < vocab_size, other=0.0)
            mass = tl.sum(row_sum, axis=0)
        threshold = kth
        if p < 1.0:
            nucleus = _largest_passing(row_ptr, vocab_size, p * mass, False, BLOCK, NUM_PROBES, BITS_END)
            threshold = tl.maximum(nucleus, kth)
        tl.store(thresholds_ptr + row, threshold)


def settle_thresholds(
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    settled: torch.Tensor,
    thresholds: torch.Tensor,
    *,
    block: int = 1024,
    num_probes: int = 4,
) -> None:
    """Write the exact threshold of every row with ``settled[i] == False`` into ``thresholds[i]``.

    ``probs`` is float32 ``[rows, vocab]`` with unit stride along the vocabulary; ``top_k`` (int64,
    ``vocab`` for off), ``top_p`` (float32, 1 for off), ``settled`` (bool) and ``thresholds``
    (float32, written in place) have one entry per row. The threshold follows
    :func:`~pagedllm.sample.sampler.filter_thresholds`: top-k keeps the ``k`` most likely tokens, top-p
    then the most likely tokens until their mass reaches ``top_p`` times the top-k set's. Nothing is
    read back to the host.
    """
    num_rows, vocab_size = probs.shape
    if probs.dtype != torch.float32 or probs.stride(1) != 1:
        raise ValueError("probs must be float32 with unit stride along the vocabulary.")
    if num_rows == 0:
        return
    launch(
        _settle_thresholds_kernel,
        (num_rows,),
        probs.device,
        probs,
        probs.stride(0),
        vocab_size,
        top_k,
        top_p,
        settled.view(torch.uint8),
        thresholds,
        BLOCK=block,
        NUM_PROBES=num_probes,
        BITS_END=_BITS_END,
        num_warps=8,
    )
