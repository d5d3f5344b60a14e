"""A projection with adapter slots: the base layer's product plus, for the rows the step's
:class:`~pagedllm.lora.mapping.LoRAMapping` gives a slot, that slot's low-rank product.

The base layer is whatever the model holds (float panels, GGUF blocks, nn.Linear); it stays as it is
and the adapters add in float. A slot holds an adapter's pairs of every sub-projection of the fused
module packed for one product each way, ``K = num_subs * max_rank`` wide: ranks ``[i * r, (i + 1) *
r)`` are sub ``i``'s (``r`` the adapter's rank), its A over the input and its B into the columns of
sub ``i``'s output; everything else in the slot is zero, so products over all ``K`` ranks are exact.

Two kernels, chosen on construction:

- ``"torch"`` (the CPU's): ``a_slots`` ``[slots, in, K]`` and ``b_slots`` ``[slots, K, out]``, the
  layouts in which the BLAS multiplies fastest. A step with one slot runs two products on its rows;
  with several, the rows of every slot are gathered into one padded batch (see
  :class:`~pagedllm.lora.mapping.PaddedRows`): one gather, two batched products, one scatter-add,
  however many slots and requests.
- ``"triton"`` (a GPU's): ``a_slots`` ``[slots, K, in]`` and ``b_slots`` ``[slots, out, K]``, read by
  one launch each of the segmented shrink and expand kernels (:mod:`pagedllm.kernels.triton.lora`).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels.cpu.decode_layers import MAX_LORA_SEGMENTS, MAX_LORA_WIDTH, LoRASlotsView
from pagedllm.kernels.triton.lora import lora_expand_add, lora_shrink
from pagedllm.lora.adapter import SubLoRA
from pagedllm.lora.mapping import LoRAMapping, current_mapping

KERNELS = ("torch", "triton")


class LoRALinear(nn.Module):
    """``base(x)`` plus each row's adapter product. Invariant: ``ranks[s]`` is the rank of the adapter
    in slot ``s`` (0: empty, or it does not target this module), and slot ``s`` is zero outside that
    adapter's pairs (an empty slot is all zeros)."""

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        sub_sizes: list[int],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        kernel: str | None = None,
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features = in_features
        self.sub_sizes = list(sub_sizes)
        self.offsets = [sum(sub_sizes[:i]) for i in range(len(sub_sizes))]
        self.out_features = sum(sub_sizes)
        self.num_subs = len(sub_sizes)
        if kernel is None:
            kernel = "triton" if device.type == "cuda" else "torch"
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}.")
        self.kernel = kernel
        self.k = k = self.num_subs * max_rank
        if kernel == "torch":
            a_shape, b_shape = (max_loras, in_features, k), (max_loras, k, self.out_features)
        else:
            a_shape, b_shape = (max_loras, k, in_features), (max_loras, self.out_features, k)
        self.a_slots: torch.Tensor
        self.b_slots: torch.Tensor
        self.register_buffer("a_slots", torch.zeros(a_shape, dtype=dtype, device=device))
        self.register_buffer("b_slots", torch.zeros(b_shape, dtype=dtype, device=device))
        self.ranks = [0] * max_loras
        # ``ranks`` as a tensor, for the native decode layers (which read it at every step).
        self.rank_table = torch.zeros(max_loras, dtype=torch.int64)

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.base, "bias", None)

    def set_slot(self, slot: int, rank: int, subs: list[SubLoRA | None] | None) -> None:
        """Put an adapter's pairs for this module in ``slot`` (``subs`` None: it does not target it)."""
        self.clear_slot(slot)
        if subs is None or all(s is None for s in subs):
            return
        a = torch.zeros(self.k, self.in_features)
        b = torch.zeros(self.out_features, self.k)
        for i, sub in enumerate(subs):
            if sub is None:
                continue
            ranks = slice(i * rank, (i + 1) * rank)
            a[ranks] = sub.a
            b[self.offsets[i] : self.offsets[i] + self.sub_sizes[i], ranks] = sub.b
        if self.kernel == "torch":
            self.a_slots[slot].copy_(a.t())
            self.b_slots[slot].copy_(b.t())
        else:
            self.a_slots[slot].copy_(a)
            self.b_slots[slot].copy_(b)
        self.ranks[slot] = rank
        self.rank_table[slot] = rank

    def clear_slot(self, slot: int) -> None:
        self.a_slots[slot].zero_()
        self.b_slots[slot].zero_()
        self.ranks[slot] = 0
        self.rank_table[slot] = 0

    def native_slots(self) -> LoRASlotsView | None:
        """The slots as the native decode layers read them (None where they cannot: another kernel's
        layout, not float32 on the CPU, or too many or too wide slots)."""
        a = self.a_slots
        if self.kernel != "torch" or a.dtype != torch.float32 or a.device.type != "cpu":
            return None
        if a.shape[0] > MAX_LORA_SEGMENTS or a.shape[2] > MAX_LORA_WIDTH:
            return None
        return LoRASlotsView(a, self.b_slots, self.rank_table, tuple(self.sub_sizes))

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
        elif len(mapping.groups) == 1:
            self._add_one_slot(x2, y2, *mapping.groups[0])
        else:
            self._add_batched(x2, y2, mapping)
        return y

    def _add_one_slot(
        self, x2: torch.Tensor, y2: torch.Tensor, slot: int, rows: slice | torch.Tensor
    ) -> None:
        """One slot's rows: two products on them."""
        if not self.ranks[slot]:
            return
        xs = x2[rows] if isinstance(rows, slice) else x2.index_select(0, rows)
        delta = torch.mm(torch.mm(xs.to(self.a_slots.dtype), self.a_slots[slot]), self.b_slots[slot])
        if isinstance(rows, slice):
            y2[rows] += delta.to(y2.dtype)
        else:
            y2.index_add_(0, rows, delta.to(y2.dtype))

    def _add_batched(self, x2: torch.Tensor, y2: torch.Tensor, mapping: LoRAMapping) -> None:
        """Several slots: one gather of their rows into a padded batch, two batched products, one
        scatter-add."""
        plan = mapping.padded()
        if not any(self.ranks[s] for s in plan.slots):
            return
        count = len(plan.slots)
        if plan.slots == tuple(range(count)):
            a, b = self.a_slots[:count], self.b_slots[:count]
        else:
            a, b = self.a_slots[plan.slot_index], self.b_slots[plan.slot_index]
        xs = x2.index_select(0, plan.index).view(count, plan.longest, self.in_features)
        shrunk = torch.bmm(xs.to(a.dtype), a)
        if plan.mask is not None:
            shrunk.mul_(plan.mask)
        delta = torch.bmm(shrunk, b).view(count * plan.longest, self.out_features)
        y2.index_add_(0, plan.index, delta.to(y2.dtype))
