"""A stand-in for the runner's native decode layers that also runs the Python forward on every step
and checks that the two agree."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedllm.attention.base import AttentionMetadata
from pagedllm.kernels.cpu.decode_layers import LoRAPlan
from pagedllm.lora.mapping import LoRAMapping, lora_rows
from pagedllm.model.llama import ForwardContext


class CheckedNativeDecode:
    """Runs the Python forward, then the native layers on the same step, and compares them."""

    def __init__(self, runner: Any, tolerance: float = 1e-5) -> None:
        """``tolerance``: relative and absolute (adapters' products are summed in another order by the
        native layers than by the BLAS, about 1e-5 apart on hidden states of order 1)."""
        self.tolerance = tolerance
        self.runner = runner
        self.native = runner.native_decode
        self.batch_sizes: list[int] = []
        self.lora_rows = 0  # rows that ran an adapter

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoRAPlan | None = None,
    ) -> torch.Tensor:
        ctx = ForwardContext(meta, self.runner.kv_cache.layers, self.runner.backend)
        mapping = None
        if lora is not None:  # the same rows' adapters for the Python forward
            row_slots = np.full(len(input_ids), -1)
            for start, count, slot in zip(
                lora.start.tolist(), lora.len.tolist(), lora.slot.tolist(), strict=True
            ):
                row_slots[lora.order[start : start + count].numpy()] = slot
            mapping = LoRAMapping.from_row_slots(row_slots)
            self.lora_rows += int((row_slots >= 0).sum())
        with lora_rows(mapping):
            expected = self.runner.model(input_ids, positions, ctx)  # writes the same K/V as the native call
        got = self.native(input_ids, positions, meta, lora)
        torch.testing.assert_close(got, expected, rtol=self.tolerance, atol=self.tolerance)
        self.batch_sizes.append(len(input_ids))
        return got
