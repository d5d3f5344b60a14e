"""Mixture-of-experts expert products as two grouped GEMM launches (Triton).

For ``T`` tokens with ``K`` experts each there are ``P = T * K`` token/expert pairs (pair ``p`` is
token ``p // K``'s ``p % K``-th choice). :func:`align_pairs_by_expert` sorts the pairs by expert and
pads each expert's run to a multiple of ``BLOCK_M``, so that every block of ``BLOCK_M`` sorted slots
belongs to one expert (padding slots hold ``P``, an invalid pair). It uses device-side torch ops only
(no host synchronisation, so the launches can be captured in a CUDA graph): the grid is sized for the
worst case, ``P + E * (BLOCK_M - 1)`` slots, and surplus blocks exit at once.

Then one launch of :func:`_grouped_gemm_kernel` multiplies every block of rows by its expert's
``gate_up`` ``[E, 2I, H]`` (rows gathered from ``x`` by token), the existing SiLU-and-mul kernel
activates, and a second launch multiplies by ``down`` ``[E, H, I]`` and scales each row by its routing
weight; each token's ``K`` rows are summed at the end. Accumulation is float32; with float32 weights
the products are exact IEEE (no TF32). On CPU tensors the kernels run in the Triton interpreter
(through :func:`pagedllm.kernels.triton.launch.launch`), which is how the tests check them.
"""

from __future__ import annotations

import torch

from pagedllm.kernels.triton import elementwise

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None  # type: ignore[assignment]


def available() -> bool:
    """Whether the triton package is installed."""
    return triton is not None


def align_pairs_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_pairs, block_expert)`` for ``topk_ids`` ``[T, K]``.

    ``sorted_pairs`` (int32, ``P + E * (block_m - 1)`` slots rounded up to whole blocks) lists the
    pairs expert by expert, in pair order within an expert, each expert's run padded with ``P`` to a
    multiple of ``block_m``; ``block_expert`` (int32, one per block) is the expert of each block, or -1
    for the surplus blocks past the last expert's run.
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    slots = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    # scatter_add rather than bincount, which reads the largest id on the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of_sorted = flat[order]
    rank = torch.arange(pairs, device=device) - count_start[expert_of_sorted]
    sorted_pairs = torch.full((slots,), pairs, dtype=torch.int32, device=device)
    sorted_pairs[padded_start[expert_of_sorted] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, slots, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


if triton is not None:

    @triton.jit
    def _grouped_gemm_kernel(
        a_ptr,
        b_ptr,
        c_ptr,
        weight_ptr,
        sorted_pairs_ptr,
        block_expert_ptr,
        num_pairs,
        N,
        K,
        top_k,
        stride_am,
        stride_be,
        stride_bn,
        stride_cm,
        A_BY_TOKEN: tl.constexpr,
        MUL_WEIGHT: tl.constexpr,
        IEEE_DOT: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """Grid ``(slot blocks, cdiv(N, BLOCK_N))``: ``c[pair, n] = a[row] . b[expert, n]`` for the
        pairs of one block of sorted slots, ``row`` being the pair's token (``A_BY_TOKEN``) or the pair
        itself; scaled by ``weight[pair]`` with ``MUL_WEIGHT``. ``a`` ``[*, K]``, ``b`` ``[E, N, K]``
        and ``c`` ``[P, N]`` have unit stride along their last dimension."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        if expert < 0:
            return
        slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_pairs_ptr + slots).to(tl.int64)
        valid = pair < num_pairs
        if A_BY_TOKEN:
            row = pair // top_k
        else:
            row = pair
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        a_rows = a_ptr + row[:, None] * stride_am
        b_cols = b_ptr + expert * stride_be + cols[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + ks < K
            a = tl.load(a_rows + (k0 + ks)[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_cols + (k0 + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST_DOT:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if IEEE_DOT:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if MUL_WEIGHT:
            w = tl.load(weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)
            acc = acc * w[:, None]
        tl.store(
            c_ptr + pair[:, None] * stride_cm + cols[None, :],
            acc.to(c_ptr.dtype.element_ty),
            mask=valid[:, None] & col_ok[None, :],
        )


def _block_sizes(device: torch.device, pairs: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)``: small blocks for decode-sized batches, bigger ones for prefill."""
    if device.type == "cpu":
        return 16, 32, 32  # the interpreter's cost grows with the number of programs
    if pairs <= 64:
        return 16, 64, 128
    return 64, 128, 64


def _gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    weights: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    top_k: int,
    *,
    by_token: bool,
    mul_weight: bool,
    blocks: tuple[int, int, int],
) -> None:
    from pagedllm.kernels.triton.launch import is_interpreted, launch

    block_m, block_n, block_k = blocks
    n, k = b.shape[1], b.shape[2]
    interpreted = is_interpreted(_grouped_gemm_kernel, a.device)
    launch(
        _grouped_gemm_kernel,
        (block_expert.numel(), triton.cdiv(n, block_n)),
        a.device,
        a,
        b,
        c,
        weights,
        sorted_pairs,
        block_expert,
        c.shape[0],
        n,
        k,
        top_k,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        A_BY_TOKEN=by_token,
        MUL_WEIGHT=mul_weight,
        IEEE_DOT=b.dtype == torch.float32,
        UPCAST_DOT=interpreted and b.dtype != torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=8 if block_m * block_n >= 8192 else 4,
    )


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` in ``x``'s dtype, with
    ``expert_e(v) = down[e] @ (silu(g) * u)`` where ``[g; u] = gate_up[e] @ v``.

    ``x`` ``[T, H]``; ``gate_up`` ``[E, 2I, H]``; ``down`` ``[E, H, I]``; ``topk_*`` ``[T, K]``.
    """
    if triton is None:
        raise RuntimeError("fused_experts needs the triton package (pip install 'pagedllm[gpu]').")
    tokens, hidden = x.shape
    num_experts, two_i, _ = gate_up.shape
    top_k = topk_ids.shape[1]
    pairs = tokens * top_k
    if pairs == 0:
        return torch.zeros_like(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    down = down if down.stride(-1) == 1 else down.contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    blocks = _block_sizes(x.device, pairs)
    sorted_pairs, block_expert = align_pairs_by_expert(topk_ids, num_experts, blocks[0])
    h = torch.empty(pairs, two_i, dtype=x.dtype, device=x.device)
    _gemm(
        x,
        gate_up,
        h,
        weights,
        sorted_pairs,
        block_expert,
        top_k,
        by_token=True,
        mul_weight=False,
        blocks=blocks,
    )
    act = elementwise.silu_and_mul(h, use_triton=True)
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    _gemm(
        act,
        down,
        y,
        weights,
        sorted_pairs,
        block_expert,
        top_k,
        by_token=False,
        mul_weight=True,
        blocks=blocks,
    )
    return y.view(tokens, top_k, hidden).sum(dim=1)
