"""A projection with adapter slots: the base layer's product plus, for the rows the step's
:class:`~pagedllm.lora.mapping.LoRAMapping` gives a slot, that slot's low-rank product.

The base layer is whatever the model holds (float panels, GGUF blocks, nn.Linear); it stays as it is
and the adapters add in float. A slot holds an adapter's pairs of every sub-projection of the fused
module packed for one product each way: rows ``[i * r, (i + 1) * r)`` of ``a_slots[slot]`` are sub
``i``'s A (``r`` the adapter's rank), and columns ``[i * r, (i + 1) * r)`` of ``b_slots[slot]`` its B,
in the rows of sub ``i``'s output; everything else in the slot is zero. So one step runs two products
per slot used (``x @ A.T``, then ``@ B.T``), whatever the number of requests: on the CPU one pair of
BLAS products per slot on its rows, on a GPU one launch each of the segmented Triton kernels
(:mod:`pagedllm.kernels.triton.lora`) for all slots at once.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels.triton.lora import lora_expand_add, lora_shrink
from pagedllm.lora.adapter import SubLoRA
from pagedllm.lora.mapping import current_mapping


class LoRALinear(nn.Module):
    """``base(x)`` plus each row's adapter product. Invariant: ``ranks[s]`` is the rank of the adapter
    in slot ``s`` (0: empty or not targeting this module), and ``a_slots[s]`` / ``b_slots[s]`` are
    zero outside that adapter's pairs (an empty slot is all zeros). ``kernel``: "torch" (BLAS
    products per slot) or "triton" (the segmented kernels; the default on CUDA)."""

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        sub_sizes: list[int],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features = in_features
        self.sub_sizes = list(sub_sizes)
        self.offsets = [sum(sub_sizes[:i]) for i in range(len(sub_sizes))]
        self.out_features = sum(sub_sizes)
        self.num_subs = len(sub_sizes)
        rows = self.num_subs * max_rank
        self.a_slots: torch.Tensor
        self.b_slots: torch.Tensor
        self.register_buffer("a_slots", torch.zeros(max_loras, rows, in_features, dtype=dtype, device=device))
        self.register_buffer(
            "b_slots", torch.zeros(max_loras, self.out_features, rows, dtype=dtype, device=device)
        )
        self.ranks = [0] * max_loras
        self.kernel = "triton" if device.type == "cuda" else "torch"

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.base, "bias", None)

    def set_slot(self, slot: int, rank: int, subs: list[SubLoRA | None] | None) -> None:
        """Put an adapter's pairs for this module in ``slot`` (``subs`` None: it does not target it)."""
        self.clear_slot(slot)
        if subs is None or all(s is None for s in subs):
            return
        a, b = self.a_slots[slot], self.b_slots[slot]
        for i, sub in enumerate(subs):
            if sub is None:
                continue
            ranks = slice(i * rank, (i + 1) * rank)
            a[ranks].copy_(sub.a)
            b[self.offsets[i] : self.offsets[i] + self.sub_sizes[i], ranks].copy_(sub.b)
        self.ranks[slot] = rank

    def clear_slot(self, slot: int) -> None:
        self.a_slots[slot].zero_()
        self.b_slots[slot].zero_()
        self.ranks[slot] = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        mapping = current_mapping()
        if mapping is None:
            return y
        x2 = x.reshape(-1, self.in_features)
        y2 = y.view(-1, self.out_features)
        if self.kernel == "triton":
            segments = mapping.segment_tensors(x2.device)
            t = lora_shrink(x2.to(self.a_slots.dtype), self.a_slots, *segments, mapping.max_seg_len)
            lora_expand_add(y2, t, self.b_slots, *segments, mapping.max_seg_len)
            return y
        for slot, rows in mapping.groups:
            k = self.num_subs * self.ranks[slot]
            if k == 0:
                continue
            xs = x2[rows] if isinstance(rows, slice) else x2.index_select(0, rows)
            shrunk = torch.mm(xs.to(self.a_slots.dtype), self.a_slots[slot, :k].t())
            delta = torch.mm(shrunk, self.b_slots[slot, :, :k].t()).to(y2.dtype)
            if isinstance(rows, slice):
                y2[rows] += delta
            else:
                y2.index_add_(0, rows, delta)
        return y
