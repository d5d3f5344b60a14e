"""The driver's commands to the other ranks, sent as tensors over the command group.

Every command is an int64 header ``[command, a, b, c, d, e]`` sent from rank 0 to each other rank,
followed, for commands that carry data, by one int64 tensor whose length the header gives:

- ``FORWARD`` (``a`` tokens, ``b`` requests, ``c`` block-table columns, ``d`` micro-batches, ``e``
  rows, -1 for all): token ids, positions and KV slots (``a`` each), query start offsets
  (``b + 1``), sequence lengths (``b``), block tables (``b * c``) and the rows (``e``) whose final
  hidden states the last stage returns to the first: everything a rank needs to build the step's
  attention metadata and run its layers. No Python object is pickled.
- ``LOGITS`` (``a`` rows, 0 for all, of forward number ``b``): sent to the first stage's other
  ranks only, which compute their vocabulary rows' logits for the driver to gather.
- ``SHUTDOWN``: the ranks leave their loop.

The driver never waits for a rank to take a command (the sends are non-blocking), so it can run its
own part of a step while the other stages still work on earlier ones; a rank that died or hangs is
found by the step's bounded collectives instead. The command group's timeout is unbounded: a rank
waits in :meth:`StepChannel.receive` for as long as the engine is idle (a driver that exits closes
the connection, which ends the wait with an error).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedllm.attention.base import AttentionMetadata

FORWARD, LOGITS, SHUTDOWN = 1, 2, 3
_HEADER = 6


@dataclass
class StepTensors:
    """One step's inputs on the host, as the driver built them."""

    input_ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64
    slot_mapping: torch.Tensor  # [tokens] int64
    query_start_loc: torch.Tensor  # [requests + 1]
    seq_lens: torch.Tensor  # [requests]
    block_tables: torch.Tensor  # [requests, columns]

    def metadata(self, device: torch.device) -> AttentionMetadata:
        """The attention metadata of these inputs, on ``device``."""
        qsl = self.query_start_loc.to(torch.int32)
        query_lens = (qsl[1:] - qsl[:-1]).tolist()
        seq_lens = self.seq_lens.to(torch.int32)
        seq_lens_cpu = seq_lens.tolist()
        return AttentionMetadata(
            slot_mapping=self.slot_mapping.to(device),
            query_start_loc=qsl.to(device),
            seq_lens=seq_lens.to(device),
            block_tables=self.block_tables.to(torch.int32).to(device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens_cpu),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens_cpu,
        )


@dataclass
class Command:
    kind: int
    step: StepTensors | None = None  # FORWARD
    micro_batches: int = 1  # FORWARD: how many micro-batches the step is cut into
    # FORWARD: the rows returned to the first stage (None: all); LOGITS: the rows wanted (empty: all).
    rows: torch.Tensor | None = None
    number: int = 0  # LOGITS: the forward whose rows they are (FORWARD commands counted from 0)


class StepChannel:
    """Commands from rank 0 (:meth:`send_*`) to every other rank (:meth:`receive`).

    Invariant: every tensor handed to a send stays referenced (``_pending``) until its send has
    completed, since the transfer may happen after the call returns.
    """

    def __init__(self, group: dist.ProcessGroup, world_size: int) -> None:
        self.group = group
        self.world_size = world_size
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self._header_buffer = torch.empty(_HEADER, dtype=torch.int64)
        self._next_header: dist.Work | None = None  # the posted receive of the next header

    def _send(self, tensor: torch.Tensor, ranks: int | None = None) -> None:
        """Send to ranks ``1 .. ranks - 1`` (default: every other rank)."""
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        for rank in range(1, ranks or self.world_size):
            work = dist.isend(tensor, dst=rank, group=self.group)
            assert work is not None
            self._pending.append((work, tensor))

    def _header(self, kind: int, *values: int, ranks: int | None = None) -> None:
        header = [kind, *values] + [0] * (_HEADER - 1 - len(values))
        self._send(torch.tensor(header, dtype=torch.int64), ranks)

    def send_forward(self, step: StepTensors, micro_batches: int, rows: torch.Tensor | None) -> None:
        """Run ``step`` in ``micro_batches`` parts; the last stage returns the final hidden states of
        ``rows`` (None: every row) to the first."""
        tokens, requests = step.input_ids.numel(), step.seq_lens.numel()
        columns = step.block_tables.shape[1] if step.block_tables.dim() == 2 else 0
        count = -1 if rows is None else rows.numel()
        rows = rows if rows is not None else torch.empty(0, dtype=torch.int64)
        self._header(FORWARD, tokens, requests, columns, micro_batches, count)
        parts = (
            step.input_ids,
            step.positions,
            step.slot_mapping,
            step.query_start_loc,
            step.seq_lens,
            step.block_tables,
            rows,
        )
        self._send(torch.cat([p.reshape(-1).to(torch.int64) for p in parts]))

    def send_logits(self, number: int, rows: torch.Tensor, ranks: int) -> None:
        """Ask ranks ``1 .. ranks - 1`` for their logits of forward ``number``'s ``rows``."""
        self._header(LOGITS, rows.numel(), number, ranks=ranks)
        if rows.numel():
            self._send(rows.to(torch.int64).contiguous(), ranks)

    def send_shutdown(self) -> None:
        self._header(SHUTDOWN)

    def _receive(self, size: int) -> torch.Tensor:
        tensor = torch.empty(size, dtype=torch.int64)
        dist.recv(tensor, src=0, group=self.group)
        return tensor

    def _post_header(self) -> None:
        work = dist.irecv(self._header_buffer, src=0, group=self.group)
        assert work is not None
        self._next_header = work

    def receive(self) -> Command:
        """The next command. Once it is in, the receive of the next header is posted (headers have
        one size), so that the driver's send of it goes through without waiting for this rank."""
        if self._next_header is None:
            self._post_header()
        assert self._next_header is not None
        self._next_header.wait()
        self._next_header = None
        kind, a, b, c, d, e = (int(v) for v in self._header_buffer.tolist())
        command = self._command(kind, a, b, c, d, e)
        if kind != SHUTDOWN:
            self._post_header()
        return command

    def _command(self, kind: int, a: int, b: int, c: int, d: int, e: int) -> Command:
        if kind == FORWARD:
            n = max(e, 0)
            payload = self._receive(3 * a + 2 * b + 1 + b * c + n)
            ids, pos, slots, qsl, lens, tables, rows = payload.split([a, a, a, b + 1, b, b * c, n])
            step = StepTensors(ids, pos, slots, qsl, lens, tables.view(b, c))
            return Command(FORWARD, step=step, micro_batches=d, rows=None if e < 0 else rows)
        if kind == LOGITS:
            rows = self._receive(a) if a else torch.empty(0, dtype=torch.int64)
            return Command(LOGITS, rows=rows, number=b)
        if kind == SHUTDOWN:
            return Command(SHUTDOWN)
        raise RuntimeError(f"unknown command {kind} from the driver rank.")
