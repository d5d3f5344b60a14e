"""Which rows of a step run which adapter slot: set by the model runner around a forward, read by
every :class:`~pagedllm.lora.layers.LoRALinear` of the model.

The mark is a :class:`contextvars.ContextVar` (like the prompt-row mark of the quantized products),
so it belongs to the thread that set it. Without a mark every row runs the base model alone.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.kernels.cpu.decode_layers import LoRAPlan


@dataclass(frozen=True)
class LoRAMapping:
    """The rows of one step grouped by adapter slot. Rows of the base model are in no group."""

    # (slot, rows) per slot used by the step: rows a slice (one contiguous run) or an int64 index
    # tensor (several runs), ascending; the groups are disjoint.
    groups: tuple[tuple[int, slice | torch.Tensor], ...]
    # Contiguous runs of one slot in batch order, for the segmented kernels: first row, length, slot.
    seg_starts: tuple[int, ...] = ()
    seg_lens: tuple[int, ...] = ()
    seg_slots: tuple[int, ...] = ()
    # The segments as int32 tensors on the device the kernels run on (built once per step, on first use).
    _device_segments: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False
    )

    # The batched plan of the CPU kernel (built once per step, on first use): see :meth:`padded`.
    _padded: list[PaddedRows] = field(default_factory=list, compare=False, repr=False)
    _native: list[LoRAPlan] = field(default_factory=list, compare=False, repr=False)

    def native_plan(self) -> LoRAPlan:
        """The rows grouped by slot as the native decode layers read them (built once per step)."""
        if not self._native:
            rows = _group_rows(self.groups)
            lens = torch.tensor([len(r) for r in rows], dtype=torch.int64)
            starts = torch.cumsum(lens, 0) - lens
            slots = torch.tensor([slot for slot, _ in self.groups], dtype=torch.int64)
            self._native.append(LoRAPlan(torch.cat(rows), starts, lens, slots))
        return self._native[0]

    def padded(self) -> PaddedRows:
        """The rows of every slot used, gathered into one ``[slots, longest, ...]`` batch (see
        :class:`PaddedRows`)."""
        if not self._padded:
            self._padded.append(PaddedRows.of(self.groups))
        return self._padded[0]

    @property
    def max_seg_len(self) -> int:
        return max(self.seg_lens, default=0)

    def segment_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(seg_starts, seg_lens, seg_slots)`` as int32 tensors on ``device``."""
        key = str(device)
        found = self._device_segments.get(key)
        if found is None:
            found = tuple(  # type: ignore[assignment]
                torch.tensor(v, dtype=torch.int32, device=device)
                for v in (self.seg_starts, self.seg_lens, self.seg_slots)
            )
            self._device_segments[key] = found  # type: ignore[assignment]
        assert found is not None
        return found

    @classmethod
    def from_row_slots(cls, row_slots: Sequence[int] | np.ndarray) -> LoRAMapping | None:
        """The mapping of a step whose row ``i`` runs slot ``row_slots[i]`` (-1: the base model);
        None when no row runs an adapter."""
        slots = np.asarray(row_slots, dtype=np.int64).reshape(-1)
        used = np.unique(slots[slots >= 0])
        if used.size == 0:
            return None
        groups = tuple((int(s), _rows(np.flatnonzero(slots == s))) for s in used)
        change = np.flatnonzero(np.diff(slots)) + 1
        starts = np.concatenate(([0], change))
        ends = np.concatenate((change, [slots.size]))
        keep = slots[starts] >= 0
        return cls(
            groups,
            tuple(int(s) for s in starts[keep]),
            tuple(int(e - s) for s, e in zip(starts[keep], ends[keep], strict=True)),
            tuple(int(slots[s]) for s in starts[keep]),
        )


@dataclass(frozen=True)
class PaddedRows:
    """Every slot's rows in one batch, for products batched over slots (``torch.bmm``): row ``j`` of
    slot ``i`` (the ``i``-th of ``slots``) is flat row ``index[i * longest + j]``. Slots with fewer
    rows than ``longest`` repeat their first row; ``mask`` (``[slots, longest, 1]``, 1.0 for real
    rows, 0.0 for repeats; None when no slot needed padding) zeroes what the repeats would add."""

    slots: tuple[int, ...]
    slot_index: torch.Tensor  # the slots as an int64 tensor
    longest: int
    index: torch.Tensor  # [slots * longest] int64
    mask: torch.Tensor | None

    @classmethod
    def of(cls, groups: tuple[tuple[int, slice | torch.Tensor], ...]) -> PaddedRows:
        rows = _group_rows(groups)
        longest = max(len(r) for r in rows)
        index = torch.stack([torch.cat((r, r[:1].expand(longest - len(r)))) for r in rows]).reshape(-1)
        mask = None
        if any(len(r) < longest for r in rows):
            mask = torch.zeros(len(rows), longest, 1)
            for i, r in enumerate(rows):
                mask[i, : len(r)] = 1.0
        slots = tuple(slot for slot, _ in groups)
        return cls(slots, torch.tensor(slots, dtype=torch.int64), longest, index, mask)


def _group_rows(groups: tuple[tuple[int, slice | torch.Tensor], ...]) -> list[torch.Tensor]:
    """Each group's rows as an int64 index tensor."""
    return [
        torch.arange(r.start, r.stop, dtype=torch.int64) if isinstance(r, slice) else r for _, r in groups
    ]


def _rows(index: np.ndarray) -> slice | torch.Tensor:
    first, last = int(index[0]), int(index[-1])
    if last - first + 1 == index.size:
        return slice(first, last + 1)
    return torch.from_numpy(index.astype(np.int64))


_CURRENT: contextvars.ContextVar[LoRAMapping | None] = contextvars.ContextVar("lora_mapping", default=None)


@contextlib.contextmanager
def lora_rows(mapping: LoRAMapping | None) -> Iterator[None]:
    """Mark the rows of the forward run inside the block (None: every row runs the base model)."""
    token = _CURRENT.set(mapping)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_mapping() -> LoRAMapping | None:
    return _CURRENT.get()
