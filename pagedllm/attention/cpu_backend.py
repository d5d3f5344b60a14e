"""CPU attention backend: decodes and prompt chunks read the paged cache in place with native kernels.

The torch reference backend gathers every decode's K/V into a padded copy before attending, which
moves each cached byte three times per layer; :func:`pagedllm.kernels.cpu.attention.paged_decode_attention`
reads each once. Prompt chunks go to :func:`~pagedllm.kernels.cpu.attention.paged_prefill_attention`,
all of a step's chunks in one call (the torch backend makes a K/V gather and an SDPA call per chunk,
whose fixed costs dominate at prompt lengths of a few hundred tokens); head sizes that are not a
multiple of 16 keep the torch path. K/V writes stay with the torch backend.

Sliding windows and logit soft-capping are kernel arguments; with a window, neither kernel reads
the blocks wholly before a query's window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.attention.base import AttentionMetadata
from pagedllm.attention.torch_backend import BatchPlan, TorchAttentionBackend
from pagedllm.kernels.cpu.attention import (
    paged_decode_attention,
    paged_prefill_attention,
    prefill_kernel_supports,
)


@dataclass
class _Decodes:
    rows: torch.Tensor | None  # flat query rows; None when the decodes are rows 0..n-1 in order
    block_tables: torch.Tensor  # int32, contiguous rows
    seq_lens: torch.Tensor  # int32
    max_len: int


class CPUAttentionBackend(TorchAttentionBackend):
    """``attention_backend="cpu"``: float32 model and KV cache on the CPU (the engine checks)."""

    name = "cpu"

    def plan_decodes(
        self, meta: AttentionMetadata, decodes: list[int], starts: list[int], device: torch.device
    ) -> object:
        if decodes == list(range(len(decodes))):  # the first rows, one per request
            tables, lens = meta.block_tables[: len(decodes)], meta.seq_lens[: len(decodes)]
            rows = None
        else:
            index = torch.tensor(decodes)
            tables, lens = meta.block_tables[index], meta.seq_lens[index]
            rows = torch.tensor([starts[i] for i in decodes])
        return _Decodes(
            rows=rows,
            block_tables=tables.contiguous(),
            seq_lens=lens.to(torch.int32).contiguous(),
            max_len=max(meta.seq_lens_cpu[i] for i in decodes),
        )

    def attend_decodes(
        self,
        query: torch.Tensor,
        out: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: object,
        scale: float,
        *,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> None:
        assert isinstance(plan, _Decodes)
        if plan.rows is None:
            n = plan.seq_lens.shape[0]
            paged_decode_attention(
                query[:n],
                k_cache,
                v_cache,
                plan.block_tables,
                plan.seq_lens,
                plan.max_len,
                scale,
                out=out[:n],
                sliding_window=sliding_window,
                soft_cap=soft_cap,
            )
        else:
            o = paged_decode_attention(
                query[plan.rows],
                k_cache,
                v_cache,
                plan.block_tables,
                plan.seq_lens,
                plan.max_len,
                scale,
                sliding_window=sliding_window,
                soft_cap=soft_cap,
            )
            out.index_copy_(0, plan.rows, o)

    def plan_prefills(
        self,
        meta: AttentionMetadata,
        prefills: list[int],
        starts: list[int],
        device: torch.device,
        head_dim: int,
    ) -> object:
        """The ``chunks`` rows of :func:`paged_prefill_attention`; the torch plan for head sizes the
        kernel does not take."""
        if not prefill_kernel_supports(head_dim):
            return super().plan_prefills(meta, prefills, starts, device, head_dim)
        return torch.tensor(
            [[i, starts[i], meta.query_lens_cpu[i], meta.seq_lens_cpu[i]] for i in prefills],
            dtype=torch.int64,
        )

    def attend_prefills(
        self,
        query: torch.Tensor,
        out: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        plan: BatchPlan,
        scale: float,
        *,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> None:
        if isinstance(plan.prefills, torch.Tensor):
            paged_prefill_attention(
                query,
                out,
                k_cache,
                v_cache,
                meta.block_tables,
                plan.prefills,
                scale,
                sliding_window=sliding_window,
                soft_cap=soft_cap,
            )
        else:
            assert sliding_window is None and soft_cap is None
            super().attend_prefills(query, out, k_cache, v_cache, meta, plan, scale)

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
        if sliding_window is None and logits_soft_cap is None:
            return super().forward(query, k_cache, v_cache, meta, scale)
        plan = self._plan_for(meta, query.device, query.shape[-1])
        if plan.prefills is not None and not isinstance(plan.prefills, torch.Tensor):
            # A head size the prefill kernel does not take: the torch path does it all.
            return super().forward(
                query,
                k_cache,
                v_cache,
                meta,
                scale,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
            )
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if plan.decodes is not None:
            self.attend_decodes(
                query,
                out,
                k_cache,
                v_cache,
                plan.decodes,
                scale,
                sliding_window=sliding_window,
                soft_cap=logits_soft_cap,
            )
        if plan.prefills is not None:
            self.attend_prefills(
                query,
                out,
                k_cache,
                v_cache,
                meta,
                plan,
                scale,
                sliding_window=sliding_window,
                soft_cap=logits_soft_cap,
            )
        return out
