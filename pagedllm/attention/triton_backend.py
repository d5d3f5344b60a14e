"""Attention backend built on the Triton kernels of :mod:`pagedllm.kernels.triton.attention`.

Runs on CUDA tensors with compiled kernels and on CPU tensors under the Triton interpreter (slow, for
tests). Importing it needs the ``triton`` package but no GPU.
"""

from __future__ import annotations

import torch

try:
    import triton  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "The 'triton' attention backend needs the triton package (pip install 'pagedllm[gpu]')."
    ) from exc

from pagedllm.attention.base import AttentionMetadata
from pagedllm.kernels.triton import attention as triton_kernels
from pagedllm.kernels.triton.attention import AttentionLaunchConfig
from pagedllm.kernels.triton.kv_write import write_kv


class TritonAttentionBackend:
    """Paged attention with Triton kernels: one launch per ``write_kv`` and one or two per ``forward``.

    ``block_m``, ``tile_n`` and ``num_splits`` override the automatic tiling (see
    :func:`pagedllm.kernels.triton.attention.choose_config`); a fixed ``num_splits`` keeps the launch
    grid of a decode batch independent of its context lengths, as CUDA graph capture requires.
    """

    name = "triton"
    supports_graph_capture = True

    def __init__(
        self,
        *,
        block_m: int | None = None,
        tile_n: int | None = None,
        num_splits: int | None = None,
    ) -> None:
        self.block_m = block_m
        self.tile_n = tile_n
        self.num_splits = num_splits
        # Every layer of a forward pass sees the same metadata: pick the tiling once per batch.
        self._config_key: tuple[object, ...] | None = None
        self._config: AttentionLaunchConfig | None = None

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        write_kv(key, value, k_cache, v_cache, slot_mapping)

    def launch_config(
        self, query: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata
    ) -> AttentionLaunchConfig:
        """The tiling ``forward`` uses for this batch."""
        key = (meta, query.shape, query.device, k_cache.shape, k_cache.dtype)
        if self._config is None or self._config_key is None or not _same_key(key, self._config_key):
            self._config = triton_kernels.choose_config(
                query, k_cache, meta, block_m=self.block_m, tile_n=self.tile_n, num_splits=self.num_splits
            )
            self._config_key = key
        return self._config

    def for_graph_capture(
        self, query: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata
    ) -> TritonAttentionBackend:
        """A backend with the tiling chosen for the bucket's longest context, fixed (split-K included)."""
        launch = triton_kernels.choose_config(query, k_cache, meta)
        return TritonAttentionBackend(
            block_m=launch.block_m, tile_n=launch.tile_n, num_splits=launch.num_splits
        )

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
        config = self.launch_config(query, k_cache, meta)
        return triton_kernels.paged_attention(
            query,
            k_cache,
            v_cache,
            meta,
            scale,
            config=config,
            sliding_window=sliding_window,
            soft_cap=logits_soft_cap,
        )


def _same_key(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    """Keys match when they hold the very same metadata object and equal shapes/dtypes."""
    return a[0] is b[0] and a[1:] == b[1:]
