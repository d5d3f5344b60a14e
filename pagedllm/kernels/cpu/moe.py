"""Mixture-of-experts expert products on the CPU, float32, through one native call
(``moe_experts_panels_f32`` in ``pagedllm/kernels/csrc/moe_cpu.c``).

The expert weights are held in the panel layout of the dense layers (:mod:`pagedllm.kernels.cpu.linear`),
packed once by :func:`pack_experts`. The call sorts the batch's token/expert pairs by expert, runs
for every expert that received pairs the gate/up product, SiLU-and-mul and the down product over that
expert's rows with the panel kernel's register tiles, OpenMP-parallel over (expert, panel) items, and
sums each token's expert outputs with its routing weights. :func:`usable` says whether tensors can
take this path (CPU, float32, kernels built).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.kernels.cpu.library import kernels_available, load_library


def usable(*tensors: torch.Tensor) -> bool:
    """Whether every tensor is a float32 CPU tensor and the kernel library is built."""
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu":
            return False
    return kernels_available()


@dataclass
class ExpertPanels:
    """One sparse layer's experts in panel form (the original ``[E, 2I, H]`` / ``[E, H, I]`` tensors
    are not needed after packing)."""

    gate_up: torch.Tensor  # E experts' panels of their [2I, H] gate/up weight, one after another
    down: torch.Tensor  # E experts' panels of their [H, I] down weight
    num_experts: int
    hidden: int  # H
    intermediate: int  # I


def pack_experts(gate_up: torch.Tensor, down: torch.Tensor) -> ExpertPanels:
    """Pack ``gate_up`` ``[E, 2I, H]`` (gate rows then up rows) and ``down`` ``[E, H, I]`` float32
    CPU tensors into panels; a shape mismatch is a ValueError."""
    num_experts, two_i, hidden = gate_up.shape
    inter = two_i // 2
    if two_i != 2 * inter or down.shape != (num_experts, hidden, inter):
        raise ValueError(
            f"moe_experts: gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} are not "
            "[E, 2I, H] and [E, H, I]."
        )
    lib = load_library()
    up_floats = lib.moe_expert_panel_floats(hidden, inter, 0)
    down_floats = lib.moe_expert_panel_floats(hidden, inter, 1)
    packed = ExpertPanels(
        torch.empty(num_experts * up_floats, dtype=torch.float32),
        torch.empty(num_experts * down_floats, dtype=torch.float32),
        num_experts,
        hidden,
        inter,
    )
    gate_up, down = gate_up.contiguous(), down.contiguous()
    for e in range(num_experts):
        lib.pack_panels_f32(
            gate_up[e].data_ptr(), 2 * inter, hidden, packed.gate_up[e * up_floats :].data_ptr()
        )
        lib.pack_panels_f32(down[e].data_ptr(), hidden, inter, packed.down[e * down_floats :].data_ptr())
    return packed


def moe_experts_packed(
    x: torch.Tensor, panels: ExpertPanels, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])``, float32 ``[T, H]``, with
    ``x`` ``[T, H]`` float32 and ``topk_ids`` ``[T, K]`` expert ids in ``[0, E)`` (else ValueError)."""
    tokens, hidden = x.shape
    if hidden != panels.hidden:
        raise ValueError(f"moe_experts: x has {hidden} columns, the experts take {panels.hidden}.")
    inter, top_k = panels.intermediate, topk_ids.shape[1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    pairs = tokens * top_k
    h = torch.empty(pairs, 2 * inter, dtype=torch.float32)
    y = torch.empty(pairs, hidden, dtype=torch.float32)
    xp = torch.empty(pairs * max(hidden, inter), dtype=torch.float32)
    out = torch.empty(tokens, hidden, dtype=torch.float32)
    rc = load_library().moe_experts_panels_f32(
        x.data_ptr(), x.stride(0), tokens, hidden, inter, panels.num_experts, top_k,
        ids.data_ptr(), weights.data_ptr(), panels.gate_up.data_ptr(), panels.down.data_ptr(),
        h.data_ptr(), y.data_ptr(), xp.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    if rc == -2:
        raise ValueError(f"moe_experts: expert ids must be in [0, {panels.num_experts}).")
    if rc:
        raise MemoryError("moe_experts: out of memory for the pair indices.")
    return out


def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """:func:`moe_experts_packed` on weights packed for this one call (tests and one-off products;
    a model packs its experts once, :class:`pagedllm.model.moe.Experts`)."""
    return moe_experts_packed(x, pack_experts(gate_up, down), topk_weights, topk_ids)
