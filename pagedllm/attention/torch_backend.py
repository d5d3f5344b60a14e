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
    blocks = cache[block_table[..., :num_blocks]]  # [..., nb, bs, kvh, d]
    shape = blocks.shape
    merged = blocks.reshape(*shape[:-4], shape[-4] * shape[-3], shape[-2], shape[-1])
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
            q = query[idx.to(query.device)].unsqueeze(2)  # [B, H, 1, d]
            o = F.scaled_dot_product_attention(
                q,
                k.transpose(1, 2).to(q.dtype),
                v.transpose(1, 2).to(q.dtype),
                attn_mask=mask[:, None, None, :],
                scale=scale,
                enable_gqa=True,
            )
            out[idx.to(query.device)] = o.squeeze(2)

        for i, (ql, sl) in enumerate(zip(qlens, slens, strict=True)):
            if ql == 1:
                continue
            s = starts[i]
            k = gather_kv(k_cache, meta.block_tables[i], sl).transpose(0, 1).to(query.dtype)  # [kvh, L, d]
            v = gather_kv(v_cache, meta.block_tables[i], sl).transpose(0, 1).to(query.dtype)
            q = query[s : s + ql].transpose(0, 1)  # [H, ql, d]
            if ql == sl:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                qpos = torch.arange(sl - ql, sl, device=query.device)
                mask = torch.arange(sl, device=query.device)[None, :] <= qpos[:, None]
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            out[s : s + ql] = o.transpose(0, 1)
        return out
