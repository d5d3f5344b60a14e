"""The one place a step's model inputs are built on the host.

:class:`StepInputBuilder` turns a :class:`~pagedllm.sched.scheduler.SchedulerOutput` into the flat-batch
arrays the forward reads (token ids, positions, slot mapping, query and sequence lengths, block
tables, the rows to sample). The eager forward copies them to the device as they are; a CUDA-graph
replay has them written, padded to its bucket, into its pinned staging buffers and copies those into
the graph's static buffers. Both therefore compute every position, slot and block table the same way.

Block tables come from :class:`~pagedllm.worker.block_tables.BlockTableRows`, shared by both paths:
a request keeps a row, maintained from the step's ``dropped_tables`` and ``block_table_changes``
(never from ``Request.block_ids``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pagedllm.request import Request
from pagedllm.sched.scheduler import SchedulerOutput
from pagedllm.worker.block_tables import BlockTableRows


@dataclass
class HostStepInputs:
    """One step's inputs on the host (numpy), laid out as :class:`AttentionMetadata` describes.

    Rows past ``num_reqs`` (decode batches padded to a CUDA-graph bucket) are padding: token 0 at
    position 0, slot -1, a context of one position in block 0.
    """

    token_ids: np.ndarray  # [num_rows] int64; 0 where a pending token is written on the device
    positions: np.ndarray  # [num_rows] int64
    slot_mapping: np.ndarray  # [num_rows] int64; -1 = no KV write
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    seq_lens: np.ndarray  # [num_seqs] int32: context length including the new tokens
    block_tables: np.ndarray  # [num_seqs, width] int32; entries past a sequence's context unused
    query_lens: list[int]  # new tokens of each real request
    num_reqs: int  # real requests (the first num_reqs sequences)
    sample_rows: list[int]  # indices into scheduled_requests of the requests that sample
    # Flat rows whose logits are sampled: each sampling request's last token, and before it, for a
    # request verifying draft tokens, its last known token and every draft but the last.
    logits_indices: list[int]
    # Per row: whether it computes a prompt token (see :func:`prompt_row_mask`); False for padding.
    prompt_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))

    @property
    def seq_lens_list(self) -> list[int]:
        return self.seq_lens[: self.num_reqs].tolist()  # type: ignore[no-any-return]


class StepInputBuilder:
    """Builds :class:`HostStepInputs` for eager and CUDA-graph steps alike."""

    def __init__(self, block_size: int, max_rows: int, max_blocks_per_seq: int) -> None:
        self.block_size = block_size
        self.block_table_rows = BlockTableRows(max_rows, max_blocks_per_seq)

    def build(
        self,
        scheduler_output: SchedulerOutput,
        *,
        padded_rows: int | None = None,
        out: DecodeInputs | None = None,
    ) -> HostStepInputs:
        """The step's inputs. A decode-only step may be padded to ``padded_rows`` and written into
        ``out`` (a CUDA graph's staging buffers); other steps get fresh arrays."""
        scheduled = scheduler_output.scheduled_requests
        requests = [s.request for s in scheduled]
        tables = self.block_table_rows
        tables.apply(scheduler_output.dropped_tables, scheduler_output.block_table_changes)
        rows = tables.rows([r.request_id for r in requests])
        sample_rows = scheduler_output.sample_rows
        if all(s.num_tokens == 1 for s in scheduled):
            host = self._decode(requests, rows, sample_rows, padded_rows, out)
        elif (
            all(s.num_tokens == 1 + len(s.draft_token_ids) for s in scheduled)
            and padded_rows is None
            and out is None
        ):
            host = self._verify(scheduler_output, rows, sample_rows)
        elif padded_rows is not None or out is not None:
            raise ValueError("only decode-only steps are padded into staging buffers.")
        else:
            host = self._mixed(scheduler_output, rows, sample_rows)
        host.prompt_rows = prompt_row_mask(scheduler_output, host.positions)
        return host

    def _decode(
        self,
        requests: list[Request],
        rows: np.ndarray,
        sample_rows: list[int],
        padded_rows: int | None,
        out: DecodeInputs | None,
    ) -> HostStepInputs:
        n = len(requests)
        padded = padded_rows if padded_rows is not None else n
        positions = [r.num_computed_tokens for r in requests]
        # A pending token (p == num_tokens) is written on the device by the model runner afterwards.
        token_ids = [
            r.all_token_ids[p] if p < r.num_tokens else 0 for r, p in zip(requests, positions, strict=True)
        ]
        # Request i is flat row i.
        return self._decode_rows(token_ids, positions, rows, padded, out, sample_rows, sample_rows)

    def _decode_rows(
        self,
        token_ids: list[int],
        positions: list[int],
        table_rows: np.ndarray,
        padded: int,
        out: DecodeInputs | None,
        sample_rows: list[int],
        logits_indices: list[int],
    ) -> HostStepInputs:
        """Inputs of one token per row (``table_rows``: each row's block-table row), padded to
        ``padded`` rows, written into ``out`` (a fresh buffer when None)."""
        n = len(token_ids)
        # Only the blocks the longest context reaches are gathered (and, for a fresh buffer, allocated).
        width = max(positions) // self.block_size + 1
        if out is None:
            out = DecodeInputs.zeros(padded, width)
        width = fill_decode_inputs(
            token_ids,
            positions,
            self.block_table_rows.array[table_rows, :width],
            self.block_size,
            padded,
            out,
        )
        return HostStepInputs(
            token_ids=out.input_ids[:padded],
            positions=out.positions[:padded],
            slot_mapping=out.slot_mapping[:padded],
            query_start_loc=np.arange(padded + 1, dtype=np.int32),
            seq_lens=out.seq_lens[:padded],
            block_tables=out.block_tables[: padded * width].reshape(padded, width),
            query_lens=[1] * n,
            num_reqs=n,
            sample_rows=sample_rows,
            logits_indices=logits_indices,
        )

    def _verify(
        self, scheduler_output: SchedulerOutput, rows: np.ndarray, sample_rows: list[int]
    ) -> HostStepInputs:
        """A decode step in which requests also verify draft tokens, laid out as a decode batch: one
        row per token, a request's latest token then its drafts, each row attending over the context
        up to its own position (every layer writes all rows' K/V before any row attends). The rows
        are computed exactly as decode rows are, so a verified token is the token decoding it one
        step at a time would give."""
        scheduled = scheduler_output.scheduled_requests
        token_ids: list[int] = []
        positions: list[int] = []
        owners: list[int] = []
        logits_indices: list[int] = []
        for i, item in enumerate(scheduled):
            req = item.request
            start = req.num_computed_tokens
            if item.needs_sample:
                logits_indices.extend(range(len(token_ids), len(token_ids) + item.num_tokens))
            token_ids += [req.all_token_ids[start], *item.draft_token_ids]
            positions += range(start, start + item.num_tokens)
            owners += [i] * item.num_tokens
        return self._decode_rows(
            token_ids, positions, rows[owners], len(token_ids), None, sample_rows, logits_indices
        )

    def _mixed(
        self, scheduler_output: SchedulerOutput, rows: np.ndarray, sample_rows: list[int]
    ) -> HostStepInputs:
        bs = self.block_size
        scheduled = scheduler_output.scheduled_requests
        ids: list[int] = []
        pos_chunks: list[np.ndarray] = []
        slot_chunks: list[np.ndarray] = []
        qlens: list[int] = []
        slens: list[int] = []
        logits_indices: list[int] = []
        width = 1
        table_rows = self.block_table_rows
        num_blocks: list[int] = []
        for row, item in zip(rows, scheduled, strict=True):
            req = item.request
            start = req.num_computed_tokens
            end = start + item.num_tokens
            drafts = item.draft_token_ids
            ids.extend(req.all_token_ids[start : end - len(drafts)])
            if drafts:  # verified by this step: every position's logits are sampled
                ids.extend(drafts)
            elif end > req.num_tokens:  # the last token is pending: filled in on the device
                ids.append(0)
            pos = np.arange(start, end, dtype=np.int64)
            pos_chunks.append(pos)
            slot_chunks.append(table_rows.array[row, pos // bs].astype(np.int64) * bs + pos % bs)
            qlens.append(item.num_tokens)
            slens.append(end)
            num_blocks.append(table_rows.num_blocks(req.request_id))
            width = max(width, num_blocks[-1])
            if item.needs_sample:
                logits_indices.extend(range(len(ids) - 1 - len(drafts), len(ids)))
        tables = table_rows.array[rows, :width]  # a copy (fancy indexing)
        for i, n in enumerate(num_blocks):
            tables[i, n:] = 0  # past its table: stale ids of a former owner
        qsl = np.zeros(len(qlens) + 1, dtype=np.int32)
        np.cumsum(qlens, out=qsl[1:])
        return HostStepInputs(
            token_ids=np.asarray(ids, dtype=np.int64),
            positions=np.concatenate(pos_chunks),
            slot_mapping=np.concatenate(slot_chunks),
            query_start_loc=qsl,
            seq_lens=np.asarray(slens, dtype=np.int32),
            block_tables=tables,
            query_lens=qlens,
            num_reqs=len(scheduled),
            sample_rows=sample_rows,
            logits_indices=logits_indices,
        )


def prompt_row_mask(scheduler_output: SchedulerOutput, positions: np.ndarray) -> np.ndarray:
    """Per row of a step laid out by :class:`StepInputBuilder` (each scheduled request's
    ``num_tokens`` rows in order, in every layout, then any padding): whether it computes a prompt
    token, i.e. its position is below its request's prompt length.

    The quantized products take the AMX tiles for prompt rows and the integer kernels for the others
    (:mod:`pagedllm.kernels.cpu.row_paths`), so a token's kind, and with it its rounding, depends on
    the token alone: a prompt token in a chunk of one row, after a prefix-cache hit or recomputed
    after preemption is a prompt row; an output token (decoded, a draft verified, or recomputed after
    preemption) never is."""
    scheduled = scheduler_output.scheduled_requests
    counts = [s.num_tokens for s in scheduled]
    lens = np.repeat(np.asarray([s.request.num_prompt_tokens for s in scheduled], dtype=np.int64), counts)
    mask = np.zeros(len(positions), dtype=bool)
    mask[: len(lens)] = positions[: len(lens)] < lens
    return mask


@dataclass
class DecodeInputs:
    """Host arrays holding one decode batch in the graph's layout.

    ``block_tables`` is flat: a batch padded to ``rows`` rows with a table ``width`` entries wide
    occupies its first ``rows * width`` elements as a contiguous ``[rows, width]`` array.
    """

    input_ids: np.ndarray  # [max_rows] int64
    positions: np.ndarray  # [max_rows] int64
    slot_mapping: np.ndarray  # [max_rows] int64
    seq_lens: np.ndarray  # [max_rows] int32
    block_tables: np.ndarray  # [max_rows * max_blocks_per_seq] int32

    @classmethod
    def zeros(cls, max_rows: int, max_blocks_per_seq: int) -> DecodeInputs:
        return cls(
            input_ids=np.zeros(max_rows, dtype=np.int64),
            positions=np.zeros(max_rows, dtype=np.int64),
            slot_mapping=np.full(max_rows, -1, dtype=np.int64),
            seq_lens=np.ones(max_rows, dtype=np.int32),
            block_tables=np.zeros(max_rows * max_blocks_per_seq, dtype=np.int32),
        )


def fill_decode_inputs(
    token_ids: Sequence[int],
    positions: Sequence[int],
    block_tables: np.ndarray,
    block_size: int,
    padded_rows: int,
    out: DecodeInputs,
) -> int:
    """Write a decode batch padded to ``padded_rows`` rows into ``out``; returns the block-table width.

    Row ``i`` computes ``token_ids[i]`` at ``positions[i]`` (its context is ``positions[i] + 1``
    tokens long) with logical-to-physical block table ``block_tables[i]`` (a 2-D int32 array; entries
    past a row's context are copied up to the width but never read). Padding rows get token 0,
    position 0, slot -1 (no KV write), a context of one position and block 0 as their first block.
    """
    n = len(token_ids)
    if not 0 < n <= padded_rows or len(positions) != n or len(block_tables) != n:
        raise ValueError(f"cannot pad a batch of {n} rows to {padded_rows}.")
    bs = block_size
    pos = out.positions[:n]
    pos[:] = positions
    used = pos // bs + 1
    width = int(used.max())
    if padded_rows * width > out.block_tables.shape[0] or block_tables.shape[1] < width:
        raise ValueError(f"a block table {width} entries wide does not fit the staging buffer.")
    out.input_ids[:n] = token_ids
    np.add(pos, 1, out=out.seq_lens[:n], casting="unsafe")
    tables = out.block_tables[: padded_rows * width].reshape(padded_rows, width)
    tables[:n] = block_tables[:, :width]
    out.slot_mapping[:n] = tables[np.arange(n), used - 1].astype(np.int64) * bs + pos % bs
    out.input_ids[n:padded_rows] = 0
    out.positions[n:padded_rows] = 0
    out.slot_mapping[n:padded_rows] = -1
    out.seq_lens[n:padded_rows] = 1
    tables[n:, 0] = 0
    return width
