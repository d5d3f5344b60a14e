"""The driver's commands to the other ranks, sent as tensors over the control group.

Every command is a broadcast from rank 0 of an int64 header ``[command, a, b, c]`` followed, for
commands that carry data, by one broadcast of an int64 tensor whose length the header gives:

- ``FORWARD`` (``a`` tokens, ``b`` requests, ``c`` block-table columns): token ids, positions and
  KV slots (``a`` each), query start offsets (``b + 1``), sequence lengths (``b``) and block tables
  (``b * c``), in that order: everything a rank needs to build the step's attention metadata and run
  its layers. No Python object is pickled.
- ``LOGITS`` (``a`` rows): the rows of the last forward whose logits the driver wants.
- ``SHUTDOWN``: the ranks leave their loop.

Other ranks call :meth:`StepChannel.receive`, which blocks until the next command (up to the
groups' timeout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedllm.attention.base import AttentionMetadata

FORWARD, LOGITS, SHUTDOWN = 1, 2, 3


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
    rows: torch.Tensor | None = None  # LOGITS


class StepChannel:
    """Commands from rank 0 (:meth:`send_*`) to every other rank (:meth:`receive`)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def _header(self, kind: int, a: int = 0, b: int = 0, c: int = 0) -> None:
        dist.broadcast(torch.tensor([kind, a, b, c], dtype=torch.int64), src=0, group=self.group)

    def send_forward(self, step: StepTensors) -> None:
        tokens, requests = step.input_ids.numel(), step.seq_lens.numel()
        columns = step.block_tables.shape[1] if step.block_tables.dim() == 2 else 0
        self._header(FORWARD, tokens, requests, columns)
        payload = torch.cat(
            [
                step.input_ids.reshape(-1).to(torch.int64),
                step.positions.reshape(-1).to(torch.int64),
                step.slot_mapping.reshape(-1).to(torch.int64),
                step.query_start_loc.reshape(-1).to(torch.int64),
                step.seq_lens.reshape(-1).to(torch.int64),
                step.block_tables.reshape(-1).to(torch.int64),
            ]
        )
        dist.broadcast(payload, src=0, group=self.group)

    def send_logits(self, rows: torch.Tensor) -> None:
        self._header(LOGITS, rows.numel())
        dist.broadcast(rows.to(torch.int64).contiguous(), src=0, group=self.group)

    def send_shutdown(self) -> None:
        self._header(SHUTDOWN)

    def receive(self) -> Command:
        header = torch.empty(4, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.group)
        kind, a, b, c = (int(v) for v in header.tolist())
        if kind == FORWARD:
            payload = torch.empty(3 * a + 2 * b + 1 + b * c, dtype=torch.int64)
            dist.broadcast(payload, src=0, group=self.group)
            ids, pos, slots, qsl, lens, tables = payload.split([a, a, a, b + 1, b, b * c])
            return Command(FORWARD, step=StepTensors(ids, pos, slots, qsl, lens, tables.view(b, c)))
        if kind == LOGITS:
            rows = torch.empty(a, dtype=torch.int64)
            dist.broadcast(rows, src=0, group=self.group)
            return Command(LOGITS, rows=rows)
        if kind == SHUTDOWN:
            return Command(SHUTDOWN)
        raise RuntimeError(f"unknown command {kind} from the driver rank.")
