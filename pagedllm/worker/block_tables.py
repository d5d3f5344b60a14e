"""Block tables of the running requests, kept as rows of one array and updated incrementally."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagedllm.request import Request


@dataclass
class _Row:
    index: int  # row of the array
    blocks: list[int]  # the request's block_ids list object the row mirrors
    filled: int  # array[index, :filled] == blocks[:filled]


class BlockTableRows:
    """Each request of consecutive decode batches keeps a row of ``array`` holding its block table.

    A decode step appends at most one block to a request's table, so :meth:`update` copies only the
    ids appended since the last batch instead of every request's whole table. Invariant: for each
    tracked request, ``array[row.index, :row.filled] == row.blocks[:row.filled]``, where
    ``row.blocks`` is the request's ``block_ids`` list object. The KV cache manager only ever extends
    that list or replaces it (freeing a request's blocks assigns a new list), so a replaced list
    resets the row; the one exception, a sliding-window model releasing blocks that left the window,
    overwrites leading entries with a placeholder in place, and the row then keeps the old ids there,
    which attention never reads (they lie wholly before every query's window). Entries past ``filled`` are stale ids of an earlier owner: readers must stop at
    the request's context length. A request missing from a batch gives its row back.
    """

    def __init__(self, max_rows: int, max_blocks_per_seq: int) -> None:
        self.array = np.zeros((max_rows, max_blocks_per_seq), dtype=np.int32)
        self._rows: dict[str, _Row] = {}
        self._free = list(range(max_rows - 1, -1, -1))

    def update(self, requests: Sequence[Request]) -> np.ndarray:
        """Bring the rows of ``requests`` up to date; returns their row indices, in order."""
        if len(requests) > self.array.shape[0]:
            raise ValueError(f"{len(requests)} requests exceed the {self.array.shape[0]} block-table rows.")
        previous = self._rows
        current: dict[str, _Row] = {}
        indices = np.empty(len(requests), dtype=np.int64)
        array = self.array
        for i, request in enumerate(requests):
            blocks = request.block_ids
            row = previous.pop(request.request_id, None)
            if row is None:
                row = _Row(self._free.pop() if self._free else self._reclaim(previous), blocks, 0)
            elif row.blocks is not blocks:
                row.blocks, row.filled = blocks, 0
            n = len(blocks)
            if n > row.filled:
                array[row.index, row.filled : n] = blocks[row.filled : n]
                row.filled = n
            current[request.request_id] = row
            indices[i] = row.index
        self._free.extend(row.index for row in previous.values())
        self._rows = current
        return indices

    def _reclaim(self, previous: dict[str, _Row]) -> int:
        """A row of a request absent from this batch (all rows are taken by the previous batch)."""
        _, row = previous.popitem()
        return row.index

    def __len__(self) -> int:
        return len(self._rows)
