"""Building blocks of decoder-only transformers: RMSNorm, rotary embedding, SwiGLU.

RMSNorm (with and without the residual add) and SiLU-and-mul run as fused Triton kernels on CUDA
tensors and as the equivalent torch code elsewhere (see :mod:`pagedllm.kernels.triton.elementwise`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.kernels.cpu import ops as cpu_ops
from pagedllm.kernels.triton import elementwise as triton_elementwise
from pagedllm.model.rope import rope_frequencies


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return triton_elementwise.rms_norm(x, self.weight, self.eps)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``: the pre-norm block's add-then-normalise."""
        return triton_elementwise.fused_add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (the "rotate half" layout of HF Llama), cos/sin cached per position.

    ``scaling`` is a config's ``rope_scaling`` (None for plain RoPE); the scheme's frequencies and
    attention factor come from :func:`pagedllm.model.rope.rope_frequencies` for a table of
    ``max_position`` rows. The attention factor (YaRN, LongRoPE) multiplies the cached cos and sin,
    so every consumer of ``cos_cache`` / ``sin_cache`` (the torch path, the native CPU rotary and
    decode layers, the Triton path) applies it without knowing the scheme. Unknown rope types and
    parameters a scheme does not use are a ValueError naming them.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None = None,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        # The rotated pairs: (i, i + head_dim / 2), or (2i, 2i + 1) (ModelConfig.rope_interleaved).
        self.interleaved = interleaved
        rope = rope_frequencies(head_dim, base, scaling, max_position)
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, rope.inv_freq)
        self.attention_factor = rope.attention_factor
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor
        self.register_buffer("cos_cache", (freqs.cos() * rope.attention_factor).float(), persistent=False)
        self.register_buffer("sin_cache", (freqs.sin() * rope.attention_factor).float(), persistent=False)

    def tables(self, positions: torch.Tensor) -> RotaryTables:
        """What rotating ``positions`` needs, prepared once per forward and shared by every layer."""
        tables = RotaryTables(positions, self.cos_cache, self.sin_cache, interleaved=self.interleaved)
        if not (cpu_ops.usable(self.cos_cache) and positions.device.type == "cpu"):
            tables.full = tables.full_rows()
        return tables


@dataclass
class RotaryTables:
    positions: torch.Tensor  # [T]
    cos_cache: torch.Tensor  # [max_pos, D / 2] float32
    sin_cache: torch.Tensor
    # The torch path's per-token rows: cos and signed sin at each dimension, each [T, 1, D]; None
    # when the native CPU kernel rotates straight from the caches.
    full: tuple[torch.Tensor, torch.Tensor] | None = None
    interleaved: bool = False  # the rotated pairs are (2i, 2i + 1), not (i, i + D / 2)

    def full_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-width rows so that a head rotates as x * cos + swap_pairs(x) * signed_sin."""
        cos = self.cos_cache[self.positions]
        sin = self.sin_cache[self.positions]
        if self.interleaved:  # (c0, c0, c1, c1, ...) and (-s0, s0, -s1, s1, ...)
            signed = torch.stack((-sin, sin), -1).flatten(-2)
            return cos.repeat_interleave(2, -1).unsqueeze(1), signed.unsqueeze(1)
        return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, heads, D]`` (any head count: q and k heads may be rotated together).

        Equal to HF's ``x * cos + rotate_half(x) * sin`` (with its pairs where ``interleaved`` puts
        them), computed in float32. On the native CPU path ``x`` is rotated in place (callers pass
        projection outputs they own).
        """
        if self.full is None and x.stride(-1) == 1 and cpu_ops.usable(x):
            return cpu_ops.rotary_(x, self.positions, self.cos_cache, self.sin_cache, self.interleaved)
        if self.full is None:
            self.full = self.full_rows()
        t, h, d = x.shape
        x32 = x.float()
        if self.interleaved:
            swapped = x32.reshape(t, h, d // 2, 2).flip(3).reshape(t, h, d)
        else:
            swapped = x32.reshape(t, h, 2, d // 2).flip(2).reshape(t, h, d)
        return torch.addcmul(x32 * self.full[0], swapped, self.full[1]).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``x = [gate, up]`` along the last dimension."""
    return triton_elementwise.silu_and_mul(x)
