"""A stand-in for the runner's native decode layers that also runs the Python forward on every step
and checks that the two agree."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.attention.base import AttentionMetadata
from pagedllm.model.llama import ForwardContext


class CheckedNativeDecode:
    """Runs the Python forward, then the native layers on the same step, and compares them."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.native = runner.native_decode
        self.batch_sizes: list[int] = []

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        ctx = ForwardContext(meta, self.runner.kv_cache.layers, self.runner.backend)
        expected = self.runner.model(input_ids, positions, ctx)  # writes the same K/V as the native call
        got = self.native(input_ids, positions, meta)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        self.batch_sizes.append(len(input_ids))
        return got
