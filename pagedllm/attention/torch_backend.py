"""Reference paged attention in plain torch (any device; the ground truth for kernel tests).

Decodes (query length 1) are batched: their K/V are gathered through the block tables into a padded
tensor and masked by sequence length. Prefill chunks are handled one request at a time with an
explicit causal mask offset by the request's already-computed context.
"""

from __future__ import annotations

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


class TorchAttentionBackend:
    name = "torch"

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        kvh, d = k_cache.shape[-2:]
        valid = slot_mapping >= 0
        if not bool(valid.all()):
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
        out = torch.empty_like(query)
        qlens = meta.query_lens_cpu
        slens = meta.seq_lens_cpu
        decode_rows = [i for i, q in enumerate(qlens) if q == 1]
        starts = [0]
        for ql in qlens:
            starts.append(starts[-1] + ql)

        if decode_rows:
            if len(decode_rows) == len(qlens):
                rows = torch.arange(len(qlens))
                idx = rows
            else:
                rows = torch.tensor(decode_rows)
                idx = torch.tensor([starts[i] for i in decode_rows])
            max_len = max(slens[i] for i in decode_rows)
            tables = meta.block_tables[rows.to(meta.block_tables.device)]
            k = gather_kv(k_cache, tables, max_len)  # [B, L, kvh, d]
            v = gather_kv(v_cache, tables, max_len)
            lens = meta.seq_lens[rows.to(meta.seq_lens.device)]
            mask = torch.arange(max_len, device=query.device)[None, :] < lens[:, None]  # [B, L]
            q = query[idx.to(query.device)]
            nb, nh, hd = q.shape
            kvh = k.shape[2]
            # Fold each KV head's group of query heads into the query-length axis: one SDPA call
            # without expanding K/V for GQA (a decode query has no causal constraint).
            o = F.scaled_dot_product_attention(
                q.view(nb, kvh, nh // kvh, hd),
                k.transpose(1, 2).to(q.dtype),
                v.transpose(1, 2).to(q.dtype),
                attn_mask=mask[:, None, None, :],
                scale=scale,
            ).reshape(nb, nh, hd)
            if len(decode_rows) == len(qlens):
                return o
            out[idx.to(query.device)] = o

        for i, (ql, sl) in enumerate(zip(qlens, slens, strict=True)):
            if ql == 1:
                continue
            s = starts[i]
            k = gather_kv(k_cache, meta.block_tables[i], sl).transpose(0, 1).to(query.dtype)  # [kvh, L, d]
            v = gather_kv(v_cache, meta.block_tables[i], sl).transpose(0, 1).to(query.dtype)
            q = query[s : s + ql].transpose(0, 1)  # [H, ql, d]
            group = q.shape[0] // k.shape[0]
            if group > 1:
                k = k.repeat_interleave(group, dim=0)
                v = v.repeat_interleave(group, dim=0)
            # An explicit causal mask offset by the cached context; on CPU this is several times
            # faster than is_causal/enable_gqa for prefill-sized chunks.
            qpos = torch.arange(sl - ql, sl, device=query.device)
            mask = torch.arange(sl, device=query.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale)
            out[s : s + ql] = o[0].transpose(0, 1)
        return out
