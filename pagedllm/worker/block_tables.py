"""Block tables of the requests that hold device blocks, kept as rows of one array and maintained
from the scheduler's block-table changes alone."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagedllm.sched.kv_cache_manager import BlockTableChange


@dataclass
class _Row:
    index: int  # row of the array
    filled: int  # entries of the request's table: array[index, :filled]


class BlockTableRows:
    """Each request the scheduler has given a block table keeps a row of ``array`` holding it.

    The rows change only through :meth:`apply`, with a step's ``dropped_tables`` and
    ``block_table_changes`` (:class:`pagedllm.sched.scheduler.SchedulerOutput`): a dropped request
    gives its row back; a change writes its ids at ``start`` and the table ends after them. A decode
    step appends at most one block to a table, so it copies one id, not every request's whole table.
    Invariant: ``array[row.index, :row.filled]`` is the table the changes describe; entries past
    ``filled`` are stale ids of an earlier owner, and readers stop at the request's context length.
    Rows are held across steps a request sits out (pipeline stages run disjoint groups), until it
    is dropped.
    """

    def __init__(self, max_rows: int, max_blocks_per_seq: int) -> None:
        self.array = np.zeros((max_rows, max_blocks_per_seq), dtype=np.int32)
        self._rows: dict[str, _Row] = {}
        self._free = list(range(max_rows - 1, -1, -1))

    def apply(self, dropped: Sequence[str], changes: Sequence[BlockTableChange]) -> None:
        """Drop the tables of ``dropped`` (ids the rows do not hold are ignored), then apply
        ``changes`` in order. ValueError when a change starts past its table's end, a table outgrows
        its row, or more requests hold tables than there are rows."""
        rows = self._rows
        for rid in dropped:
            row = rows.pop(rid, None)
            if row is not None:
                self._free.append(row.index)
        array = self.array
        for change in changes:
            row = rows.get(change.request_id)
            if row is None:
                if not self._free:
                    raise ValueError(f"more than {array.shape[0]} requests hold block tables.")
                row = rows[change.request_id] = _Row(self._free.pop(), 0)
            start, end = change.start, change.start + len(change.block_ids)
            if start > row.filled:
                raise ValueError(
                    f"request {change.request_id}: a block-table change at entry {start} of a table "
                    f"of {row.filled} entries."
                )
            if end > array.shape[1]:
                raise ValueError(
                    f"request {change.request_id}: {end} blocks exceed the {array.shape[1]} of a table."
                )
            array[row.index, start:end] = change.block_ids
            row.filled = end

    def rows(self, request_ids: Sequence[str]) -> np.ndarray:
        """The row indices of ``request_ids``, in order (KeyError naming one the rows do not hold)."""
        rows = self._rows
        indices = np.empty(len(request_ids), dtype=np.int64)
        for i, rid in enumerate(request_ids):
            row = rows.get(rid)
            if row is None:
                raise KeyError(f"request {rid!r} has no block table: the scheduler sent none.")
            indices[i] = row.index
        return indices

    def num_blocks(self, request_id: str) -> int:
        """Entries in the request's table."""
        return self._rows[request_id].filled

    def __len__(self) -> int:
        return len(self._rows)
