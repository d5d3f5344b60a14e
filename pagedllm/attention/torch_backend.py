"""Reference paged attention in plain torch (any device; the ground truth for kernel tests).

Decodes (query length 1) are batched: their K/V are gathered through the block tables into a padded
tensor and masked by sequence length. Prefill chunks are handled one request at a time with an
explicit causal mask offset by the request's already-computed context.

A sliding window (a query at position p sees keys in ``(p - window, p]``) and logit soft-capping
(``cap * tanh(score / cap)`` before the softmax) take a separate path (:class:`WindowPlan`): it
gathers only the blocks that hold keys inside some query's window, so blocks wholly before the
window are never read (a KV cache manager may have released them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedllm.attention.base import AttentionMetadata


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """K or V of the first ``length`` positions of sequences: ``[..., length, kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    ids = block_table[..., :num_blocks]
    # index_select copies whole blocks with memcpy: much faster than advanced indexing on CPU.
    blocks = cache.index_select(0, ids.reshape(-1).long())
    merged = blocks.view(*ids.shape[:-1], num_blocks * block_size, cache.shape[-2], cache.shape[-1])
    return merged[..., :length, :, :]


# Cost of one extra decode group (a gather + SDPA call), in padded key positions: splitting the
# decodes into groups of similar lengths pays off once it saves more padding than this.
_GROUP_COST_POSITIONS = 1024


def group_by_length(lengths: list[int], group_cost: int = _GROUP_COST_POSITIONS) -> list[list[int]]:
    """Split indices of ``lengths`` into groups of similar length, minimising the padded positions
    ``sum(len(group) * max length in group)`` plus ``group_cost`` per group.

    Exact for that cost: an O(n^2) dynamic programme over the indices sorted by length.
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    n = len(order)
    best = [0] * (n + 1)  # best[j]: cost of grouping the j shortest
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[order[j - 1]]
        best[j], cut[j] = min((best[i] + (j - i) * longest + group_cost, i) for i in range(j))
    groups = []
    j = n
    while j > 0:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return groups[::-1]


@dataclass
class DecodeGroup:
    """Decodes of similar context length, attended in one padded SDPA call."""

    rows: torch.Tensor  # flat query rows
    tables: torch.Tensor  # their block tables
    mask: torch.Tensor | None  # [n, 1, 1, max_len] additive (0 or -inf); None when nothing is padded
    max_len: int


@dataclass
class BatchPlan:
    """Per-step index tensors and masks, shared by every layer of one forward.

    ``decodes`` is whatever the backend's ``plan_decodes`` built for the batch's decodes (requests
    with query length 1), ``prefills`` what its ``plan_prefills`` built for the prompt chunks (query
    length above 1); each None when there are none.
    """

    starts: list[int]  # first query row of each request (and the total row count last)
    decodes: object | None
    prefills: object | None
    # Plans of the window / soft-cap path, by window (None: full causal), built on first use.
    windowed: dict[int | None, WindowPlan] = field(default_factory=dict)


@dataclass
class WindowSpan:
    """Requests whose K/V are gathered together: each request's blocks ``first_block[i]`` on, as
    ``tables`` (``[n, num_blocks]``, indices clamped into the table) and ``mask`` (bool
    ``[n, 1, rows, num_blocks * block_size]``, True where a query row may attend).

    ``unread`` (``[n, 1, L, 1]``) marks gathered positions no query attends to: they are zeroed after
    the gather, since slots past a request's context or before its window may hold anything (even
    NaN, which a masked softmax would still propagate)."""

    reqs: list[int]
    tables: torch.Tensor
    mask: torch.Tensor
    unread: torch.Tensor
    length: int  # gathered positions, num_blocks * block_size


@dataclass
class WindowPlan:
    """The window / soft-cap path's plan of one batch: decodes in groups of similar span, prompt
    chunks one request each (rows ``starts[i]:starts[i + 1]``)."""

    decodes: list[tuple[torch.Tensor, WindowSpan]]  # (flat query rows, span)
    prefills: list[WindowSpan]


def window_span(
    meta: AttentionMetadata,
    reqs: list[int],
    block_size: int,
    window: int | None,
    device: torch.device,
) -> WindowSpan:
    """The gather plan for requests ``reqs``, all with the same query length ``q``.

    Request i's queries sit at positions ``seq_len - q ... seq_len - 1``; the first key any of them
    sees is ``max(0, seq_len - q - window + 1)`` (0 without a window), so blocks before that key's
    block are left out.
    """
    ql = meta.query_lens_cpu[reqs[0]]
    seq = torch.tensor([meta.seq_lens_cpu[i] for i in reqs], device=device)
    first = torch.zeros_like(seq) if window is None else (seq - ql - window + 1).clamp(min=0) // block_size
    last = (seq - 1) // block_size
    nblk = int((last - first).max().item()) + 1
    cols = first[:, None] + torch.arange(nblk, device=device)[None, :]
    table_rows = meta.block_tables[torch.tensor(reqs, device=meta.block_tables.device)]
    width = table_rows.shape[1]
    tables = table_rows.gather(1, cols.clamp(max=width - 1).to(table_rows.device))
    key_pos = (first[:, None] * block_size + torch.arange(nblk * block_size, device=device)[None, :])[
        :, None, :
    ]
    q_pos = (seq[:, None] - ql + torch.arange(ql, device=device)[None, :])[:, :, None]
    mask = key_pos <= q_pos  # [n, ql, L]
    if window is not None:
        mask &= key_pos > q_pos - window
    unread = ~mask.any(dim=1)[:, None, :, None]
    return WindowSpan(reqs=reqs, tables=tables, mask=mask[:, None], unread=unread, length=nblk * block_size)


def _gather_span(
    k_cache: torch.Tensor, v_cache: torch.Tensor, span: WindowSpan, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a span as ``[n, kv_heads, L, head_dim]``, zero where no query attends."""
    k = gather_kv(k_cache, span.tables, span.length).transpose(1, 2).to(dtype)
    v = gather_kv(v_cache, span.tables, span.length).transpose(1, 2).to(dtype)
    return k.masked_fill(span.unread, 0.0), v.masked_fill(span.unread, 0.0)


def attend_masked(
    q: torch.Tensor,  # [B, H, M, d]
    k: torch.Tensor,  # [B, KVH, L, d]
    v: torch.Tensor,
    mask: torch.Tensor,  # bool, [B, 1, M, L]: True where a query row may attend
    scale: float,
    soft_cap: float | None,
) -> torch.Tensor:  # [B, H, M, d]
    """Attention with an explicit mask; query head h reads KV head ``h // (H // KVH)``."""
    if soft_cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    b, h, m, d = q.shape
    kvh, length = k.shape[1], k.shape[2]
    g = h // kvh
    scores = torch.matmul(q.reshape(b, kvh, g * m, d), k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap
    scores = scores.view(b, kvh, g, m, length).masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(b, kvh, g * m, length)
    return torch.matmul(probs, v).view(b, h, m, d)


def _decode_group(
    meta: AttentionMetadata, reqs: list[int], starts: list[int], device: torch.device
) -> DecodeGroup:
    lens = [meta.seq_lens_cpu[i] for i in reqs]
    max_len = max(lens)
    mask = None
    if min(lens) != max_len:
        lens_t = torch.tensor(lens, device=device)
        padded = torch.arange(max_len, device=device)[None, :] >= lens_t[:, None]
        mask = torch.zeros(padded.shape, device=device).masked_fill_(padded, float("-inf"))[:, None, None, :]
    return DecodeGroup(
        rows=torch.tensor([starts[i] for i in reqs], device=device),
        tables=meta.block_tables[torch.tensor(reqs, device=meta.block_tables.device)],
        mask=mask,
        max_len=max_len,
    )


class TorchAttentionBackend:
    """Reference backend. Index tensors and masks are built once per batch (per metadata object)
    and reused by every layer.

    Subclasses may replace how decodes and prompt chunks are attended by overriding
    :meth:`plan_decodes` / :meth:`attend_decodes` and :meth:`plan_prefills` / :meth:`attend_prefills`.
    """

    name = "torch"
    supports_graph_capture = False

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._batch_plan: BatchPlan | None = None
        self._slots: torch.Tensor | None = None
        self._valid_slots: torch.Tensor | None = None  # rows to write of ``_slots``; None = all

    def _plan_for(self, meta: AttentionMetadata, device: torch.device, head_dim: int) -> BatchPlan:
        if self._meta is not meta or self._batch_plan is None:
            self._batch_plan = self.plan(meta, device, head_dim)
            self._meta = meta
        return self._batch_plan

    def plan(self, meta: AttentionMetadata, device: torch.device, head_dim: int) -> BatchPlan:
        qlens = meta.query_lens_cpu
        starts = [0]
        for ql in qlens:
            starts.append(starts[-1] + ql)
        # A prompt token alone in its chunk is attended as a chunk, not as a decode: the two paths
        # round differently, and a prompt token must give the same bits in a chunk of any length.
        chunks = set(meta.single_prompt_seqs)
        decodes = [i for i, q in enumerate(qlens) if q == 1 and i not in chunks]
        prefills = [i for i, q in enumerate(qlens) if q > 1 or i in chunks]
        return BatchPlan(
            starts=starts,
            decodes=self.plan_decodes(meta, decodes, starts, device) if decodes else None,
            prefills=self.plan_prefills(meta, prefills, starts, device, head_dim) if prefills else None,
        )

    def plan_prefills(
        self,
        meta: AttentionMetadata,
        prefills: list[int],
        starts: list[int],
        device: torch.device,
        head_dim: int,
    ) -> object:
        """Request index -> its ``[query_len, seq_len]`` causal mask offset by the cached context, or
        None for a chunk without cached context (plain causal attention)."""
        masks: dict[int, torch.Tensor | None] = {}
        for i in prefills:
            ql, sl = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
            if ql == sl:
                masks[i] = None
            else:
                qpos = torch.arange(sl - ql, sl, device=device)
                masks[i] = torch.arange(sl, device=device)[None, :] <= qpos[:, None]
        return masks

    def plan_decodes(
        self, meta: AttentionMetadata, decodes: list[int], starts: list[int], device: torch.device
    ) -> object:
        """Groups of similar length (see :func:`group_by_length`)."""
        groups = group_by_length([meta.seq_lens_cpu[i] for i in decodes])
        return [_decode_group(meta, [decodes[j] for j in g], starts, device) for g in groups]

    def attend_decodes(
        self,
        query: torch.Tensor,
        out: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: object,
        scale: float,
    ) -> None:
        assert isinstance(plan, list)
        for group in plan:
            k = gather_kv(k_cache, group.tables, group.max_len)  # [B, L, kvh, d]
            v = gather_kv(v_cache, group.tables, group.max_len)
            q = query[group.rows]
            nb, nh, hd = q.shape
            kvh = k.shape[2]
            # Fold each KV head's group of query heads into the query-length axis: one SDPA call
            # without expanding K/V for GQA (a decode query has no causal constraint).
            o = F.scaled_dot_product_attention(
                q.view(nb, kvh, nh // kvh, hd),
                k.transpose(1, 2).to(q.dtype),
                v.transpose(1, 2).to(q.dtype),
                attn_mask=None if group.mask is None else group.mask.to(q.dtype),
                scale=scale,
            )
            out.index_copy_(0, group.rows, o.reshape(nb, nh, hd))

    def attend_prefills(
        self,
        query: torch.Tensor,
        out: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        plan: BatchPlan,
        scale: float,
    ) -> None:
        assert isinstance(plan.prefills, dict)
        for i, mask in plan.prefills.items():
            ql, sl = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
            s = plan.starts[i]
            k = gather_kv(k_cache, meta.block_tables[i], sl).transpose(0, 1).to(query.dtype)  # [kvh, L, d]
            v = gather_kv(v_cache, meta.block_tables[i], sl).transpose(0, 1).to(query.dtype)
            q = query[s : s + ql].transpose(0, 1)  # [H, ql, d]
            # GQA without copying K/V for each query head. A chunk after cached context needs the
            # causal mask offset by that context; a whole prompt is plain causal, which the CPU
            # kernel computes faster (it skips the masked half).
            o = F.scaled_dot_product_attention(
                q[None],
                k[None],
                v[None],
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=True,
            )
            out[s : s + ql] = o[0].transpose(0, 1)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        kvh, d = k_cache.shape[-2:]
        if self._slots is not slot_mapping:  # once per forward, not per layer
            self._slots = slot_mapping
            self._valid_slots = (slot_mapping >= 0).nonzero().squeeze(1) if (slot_mapping < 0).any() else None
        if self._valid_slots is not None:
            rows = self._valid_slots
            key, value, slot_mapping = key[rows], value[rows], slot_mapping[rows]
        k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, value.to(v_cache.dtype))

    def for_graph_capture(
        self, query: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata
    ) -> TorchAttentionBackend:
        raise NotImplementedError(f"the {self.name} attention backend does not support CUDA graphs.")

    def window_plan(
        self,
        meta: AttentionMetadata,
        plan: BatchPlan,
        block_size: int,
        window: int | None,
        device: torch.device,
    ) -> WindowPlan:
        """The window / soft-cap path's plan for this batch and window (cached on ``plan``)."""
        wp = plan.windowed.get(window)
        if wp is not None:
            return wp
        qlens = meta.query_lens_cpu
        decodes = [i for i, q in enumerate(qlens) if q == 1]
        spans = [
            meta.seq_lens_cpu[i] if window is None else min(meta.seq_lens_cpu[i], window + block_size)
            for i in decodes
        ]
        decode_groups = []
        for g in group_by_length(spans) if decodes else []:
            reqs = [decodes[j] for j in g]
            rows = torch.tensor([plan.starts[i] for i in reqs], device=device)
            decode_groups.append((rows, window_span(meta, reqs, block_size, window, device)))
        prefills = [window_span(meta, [i], block_size, window, device) for i, q in enumerate(qlens) if q > 1]
        wp = WindowPlan(decodes=decode_groups, prefills=prefills)
        plan.windowed[window] = wp
        return wp

    def attend_windowed(
        self,
        query: torch.Tensor,
        out: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: BatchPlan,
        wp: WindowPlan,
        scale: float,
        soft_cap: float | None,
    ) -> None:
        """Attention of the window / soft-cap path (see :class:`WindowPlan`)."""
        for rows, span in wp.decodes:
            k, v = _gather_span(k_cache, v_cache, span, query.dtype)  # [n, kvh, L, d]
            q = query[rows]
            nb, nh, hd = q.shape
            kvh = k.shape[1]
            # As in attend_decodes: each KV head's query heads become the query-length axis.
            o = attend_masked(q.view(nb, kvh, nh // kvh, hd), k, v, span.mask, scale, soft_cap)
            out.index_copy_(0, rows, o.reshape(nb, nh, hd))
        for span in wp.prefills:
            i = span.reqs[0]
            s, e = plan.starts[i], plan.starts[i + 1]
            k, v = _gather_span(k_cache, v_cache, span, query.dtype)  # [1, kvh, L, d]
            q = query[s:e].transpose(0, 1)[None]  # [1, H, ql, d]
            o = attend_masked(q, k, v, span.mask, scale, soft_cap)
            out[s:e] = o[0].transpose(0, 1)

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        plan = self._plan_for(meta, query.device, query.shape[-1])
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if sliding_window is not None or logits_soft_cap is not None:
            wp = self.window_plan(meta, plan, k_cache.shape[1], sliding_window, query.device)
            self.attend_windowed(query, out, k_cache, v_cache, plan, wp, scale, logits_soft_cap)
            return out
        if plan.decodes is not None:
            self.attend_decodes(query, out, k_cache, v_cache, plan.decodes, scale)
        if plan.prefills is not None:
            self.attend_prefills(query, out, k_cache, v_cache, meta, plan, scale)
        return out
