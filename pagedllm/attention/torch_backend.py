"""Reference paged attention in plain torch (any device; the ground truth for kernel tests).

Decodes (query length 1) are batched: their K/V are gathered through the block tables into a padded
tensor and masked by sequence length. Prefill chunks are handled one request at a time with an
explicit causal mask offset by the request's already-computed context.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class _BatchPlan:
    """Per-step index tensors and masks, shared by every layer of one forward."""

    starts: list[int]  # first query row of each request
    decode_rows: torch.Tensor | None  # flat query rows of the decodes (None: no decode)
    decode_tables: torch.Tensor | None
    decode_mask: torch.Tensor | None  # [num_decodes, max_len], True where a position exists
    decode_max_len: int
    all_decode: bool
    prefill_masks: dict[int, torch.Tensor]  # request index -> [query_len, seq_len] causal mask


def _plan(meta: AttentionMetadata, device: torch.device) -> _BatchPlan:
    qlens, slens = meta.query_lens_cpu, meta.seq_lens_cpu
    starts = [0]
    for ql in qlens:
        starts.append(starts[-1] + ql)
    decodes = [i for i, q in enumerate(qlens) if q == 1]
    decode_rows = decode_tables = decode_mask = None
    max_len = 0
    if decodes:
        reqs = torch.tensor(decodes, device=meta.block_tables.device)
        decode_rows = torch.tensor([starts[i] for i in decodes], device=device)
        max_len = max(slens[i] for i in decodes)
        decode_tables = meta.block_tables[reqs]
        lens = meta.seq_lens[reqs.to(meta.seq_lens.device)].to(device)
        decode_mask = torch.arange(max_len, device=device)[None, :] < lens[:, None]
    prefill_masks = {}
    for i, (ql, sl) in enumerate(zip(qlens, slens, strict=True)):
        if ql > 1:
            qpos = torch.arange(sl - ql, sl, device=device)
            prefill_masks[i] = torch.arange(sl, device=device)[None, :] <= qpos[:, None]
    return _BatchPlan(
        starts=starts,
        decode_rows=decode_rows,
        decode_tables=decode_tables,
        decode_mask=decode_mask,
        decode_max_len=max_len,
        all_decode=len(decodes) == len(qlens),
        prefill_masks=prefill_masks,
    )


class TorchAttentionBackend:
    """Reference backend. Index tensors and masks are built once per batch (per metadata object)
    and reused by every layer."""

    name = "torch"

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._batch_plan: _BatchPlan | None = None

    def _plan_for(self, meta: AttentionMetadata, device: torch.device) -> _BatchPlan:
        if self._meta is not meta or self._batch_plan is None:
            self._batch_plan = _plan(meta, device)
            self._meta = meta
        return self._batch_plan

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        kvh, d = k_cache.shape[-2:]
        if (slot_mapping < 0).any():
            valid = slot_mapping >= 0
            key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
        k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, value.to(v_cache.dtype))

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        plan = self._plan_for(meta, query.device)
        out = torch.empty_like(query)
        if plan.decode_rows is not None:
            assert plan.decode_tables is not None and plan.decode_mask is not None
            k = gather_kv(k_cache, plan.decode_tables, plan.decode_max_len)  # [B, L, kvh, d]
            v = gather_kv(v_cache, plan.decode_tables, plan.decode_max_len)
            q = query if plan.all_decode else query[plan.decode_rows]
            nb, nh, hd = q.shape
            kvh = k.shape[2]
            # Fold each KV head's group of query heads into the query-length axis: one SDPA call
            # without expanding K/V for GQA (a decode query has no causal constraint).
            o = F.scaled_dot_product_attention(
                q.view(nb, kvh, nh // kvh, hd),
                k.transpose(1, 2).to(q.dtype),
                v.transpose(1, 2).to(q.dtype),
                attn_mask=plan.decode_mask[:, None, None, :],
                scale=scale,
            ).reshape(nb, nh, hd)
            if plan.all_decode:
                return o
            out[plan.decode_rows] = o

        for i, mask in plan.prefill_masks.items():
            ql, sl = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
            s = plan.starts[i]
            k = gather_kv(k_cache, meta.block_tables[i], sl).transpose(0, 1).to(query.dtype)  # [kvh, L, d]
            v = gather_kv(v_cache, meta.block_tables[i], sl).transpose(0, 1).to(query.dtype)
            q = query[s : s + ql].transpose(0, 1)  # [H, ql, d]
            group = q.shape[0] // k.shape[0]
            if group > 1:
                k = k.repeat_interleave(group, dim=0)
                v = v.repeat_interleave(group, dim=0)
            # An explicit causal mask offset by the cached context; on CPU this is several times
            # faster than is_causal/enable_gqa for prefill-sized chunks.
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale)
            out[s : s + ql] = o[0].transpose(0, 1)
        return out
