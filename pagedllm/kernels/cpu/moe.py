"""Mixture-of-experts expert products on the CPU, float32, through one native call
(``moe_experts_f32`` in ``pagedllm/kernels/csrc/moe_cpu.c``).

The call sorts the batch's token/expert pairs by expert and runs, for every expert that received
pairs, the gate/up product, SiLU-and-mul and the down product over that expert's rows, OpenMP-parallel
over (expert, block of weight rows); then sums each token's expert outputs with its routing weights.
:func:`usable` says whether tensors can take this path (CPU, float32, kernels built).
"""

from __future__ import annotations

import torch

from pagedllm.kernels.cpu.library import kernels_available, load_library


def usable(*tensors: torch.Tensor) -> bool:
    """Whether every tensor is a float32 CPU tensor and the kernel library is built."""
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu":
            return False
    return kernels_available()


def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])``, float32 ``[T, H]``.

    ``x`` is ``[T, H]``; ``gate_up`` ``[E, 2I, H]`` (gate rows then up rows) and ``down`` ``[E, H, I]``
    float32; ``topk_ids`` ``[T, K]`` expert ids in ``[0, E)``; ``topk_weights`` ``[T, K]``.
    An expert id out of range is a ValueError.
    """
    tokens, hidden = x.shape
    num_experts, two_i, _ = gate_up.shape
    inter = two_i // 2
    if gate_up.shape != (num_experts, 2 * inter, hidden) or down.shape != (num_experts, hidden, inter):
        raise ValueError(
            f"moe_experts: gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} do not match "
            f"hidden size {hidden} as [E, 2I, H] and [E, H, I]."
        )
    top_k = topk_ids.shape[1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    gate_up, down = gate_up.contiguous(), down.contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    pairs = tokens * top_k
    h = torch.empty(pairs, 2 * inter, dtype=torch.float32)
    y = torch.empty(pairs, hidden, dtype=torch.float32)
    out = torch.empty(tokens, hidden, dtype=torch.float32)
    rc = load_library().moe_experts_f32(
        x.data_ptr(), x.stride(0), tokens, hidden, inter, num_experts, top_k,
        ids.data_ptr(), weights.data_ptr(), gate_up.data_ptr(), down.data_ptr(),
        h.data_ptr(), y.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    if rc == -2:
        raise ValueError(f"moe_experts: expert ids must be in [0, {num_experts}).")
    if rc:
        raise MemoryError("moe_experts: out of memory for the pair indices.")
    return out
