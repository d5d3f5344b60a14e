"""Which attention backend a model runs with: the requested one, checked, or the best available."""

from __future__ import annotations

import torch

from pagedllm.attention.base import AttentionBackend


def get_attention_backend(name: str) -> AttentionBackend:
    if name == "torch":
        from pagedllm.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "cpu":
        from pagedllm.attention.cpu_backend import CPUAttentionBackend

        return CPUAttentionBackend()
    if name == "triton":
        from pagedllm.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"attention_backend must be 'torch', 'cpu' or 'triton', got {name!r}.")


def choose_attention_backend(requested: str | None, device: torch.device, dtype: torch.dtype) -> str:
    """The backend to use: ``requested``, checked, or the best available when it is None.

    Default: ``"triton"`` on CUDA; on the CPU ``"cpu"`` for float32 models when its native kernel
    builds (see :mod:`pagedllm.kernels.cpu.library`), else ``"torch"``.
    """
    if requested == "cpu":
        from pagedllm.kernels.cpu.library import load_library

        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError("attention_backend 'cpu' needs device 'cpu' and dtype float32.")
        load_library()  # raises with the compiler's message
        return requested
    if requested is not None:
        return requested
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu" and dtype == torch.float32:
        from pagedllm.kernels.cpu.library import kernels_available

        if kernels_available():
            return "cpu"
    return "torch"
