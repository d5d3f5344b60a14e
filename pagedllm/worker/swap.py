"""The host tier's KV tensors, the block copies between them and the device's, and the start-up
measurements that ``auto`` preemption weighs (:class:`~pagedllm.sched.preemption.PreemptionCosts`)."""

from __future__ import annotations

import time

import torch

from pagedllm.model.config import ModelConfig
from pagedllm.sched.preemption import PreemptionCosts
from pagedllm.worker.kv_cache import KVCache


class HostKVCache:
    """``num_blocks`` blocks laid out as the device's KV cache (``[2, layers, blocks, ...]``), in host
    memory (pinned when the device is a GPU, so that copies run at full bandwidth)."""

    def __init__(self, device_cache: KVCache, num_blocks: int) -> None:
        shape = list(device_cache.storage.shape)
        shape[2] = num_blocks
        pinned = device_cache.storage.device.type == "cuda"
        self.storage = torch.zeros(shape, dtype=device_cache.storage.dtype, pin_memory=pinned)
        self.num_blocks = num_blocks

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def copy(self, device_cache: KVCache, out: list[tuple[int, int]], into: list[tuple[int, int]]) -> None:
        """Copy ``out`` pairs (device block, host block), then ``into`` pairs (host block, device
        block). Both finish before this returns, so the host blocks may be reused at once."""
        device = device_cache.storage
        if out:
            src = torch.tensor([d for d, _ in out], device=device.device)
            dst = torch.tensor([h for _, h in out])
            self.storage.index_copy_(2, dst, device.index_select(2, src).to("cpu"))
        if into:
            src = torch.tensor([h for h, _ in into])
            dst = torch.tensor([d for _, d in into], device=device.device)
            device.index_copy_(2, dst, self.storage.index_select(2, src).to(device.device))
            if device.device.type == "cuda":
                torch.cuda.synchronize(device.device)


def measure_costs(
    model_config: ModelConfig, device_cache: KVCache, host: HostKVCache, num_params: int
) -> PreemptionCosts:
    """Time block copies both ways and a matrix product in the model's dtype on its device."""
    device = device_cache.storage.device
    dtype = device_cache.storage.dtype
    n = min(8, host.num_blocks, device_cache.num_blocks)
    pairs = [(i, i) for i in range(n)]
    saved = device_cache.storage[:, :, :n].clone()
    host.copy(device_cache, pairs, pairs)  # warm-up
    started = time.perf_counter()
    for _ in range(3):
        host.copy(device_cache, pairs, pairs)
    seconds = max(time.perf_counter() - started, 1e-9)
    device_cache.storage[:, :, :n] = saved
    block_bytes = device_cache.storage[:, :, :1].numel() * device_cache.storage.element_size()
    copy_rate = 3 * 2 * n * block_bytes / seconds
    hidden = model_config.hidden_size
    a = torch.randn(256, hidden, dtype=dtype, device=device)
    b = torch.randn(hidden, 4 * hidden, dtype=dtype, device=device)
    (a @ b).sum().item()  # warm-up
    started = time.perf_counter()
    for _ in range(3):
        (a @ b).sum().item()
    flop_rate = 3 * 2 * 256 * hidden * 4 * hidden / max(time.perf_counter() - started, 1e-9)
    cfg = model_config
    return PreemptionCosts(
        block_bytes=block_bytes,
        copy_bytes_per_s=copy_rate,
        flops_per_token=2.0 * num_params,
        attention_flops_per_pair=4.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim,
        flops_per_s=flop_rate,
    )


def forward_parameters(cfg: ModelConfig) -> int:
    """Weights a token's forward multiplies by (every matrix but the embedding lookup; the LM head
    once even when tied; every expert of a sparse layer, an upper bound)."""
    shapes = cfg.weight_shapes()
    total = sum(
        a * b
        for name, (a, b) in ((n, s) for n, s in shapes.items() if len(s) == 2)
        if "embed_tokens" not in name
    )
    if cfg.tie_word_embeddings:
        total += cfg.vocab_size * cfg.hidden_size
    return total
