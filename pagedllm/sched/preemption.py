"""What preempting a request costs, by swapping its KV to the host tier or by recomputing it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PreemptionCosts:
    """The figures ``auto`` preemption weighs, measured when the engine starts.

    Swapping costs two copies of the request's blocks (out now, in later) at the measured copy
    bandwidth; recomputing costs the forward over its computed tokens (weights and attention) at the
    measured rate of floating-point operations. Recompute is counted in full, though a recomputed
    request often finds part of its prefix still cached.
    """

    block_bytes: int  # one KV block, every layer's K and V
    copy_bytes_per_s: float  # measured device <-> host tier copy bandwidth
    flops_per_token: float  # one token's forward through the weights (2 x parameters)
    attention_flops_per_pair: float  # one query-key pair, every layer (4 x layers x heads x head_dim)
    flops_per_s: float  # measured rate of the device's matrix products

    def swap_s(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.block_bytes / self.copy_bytes_per_s

    def recompute_s(self, num_tokens: int) -> float:
        pairs = num_tokens * (num_tokens + 1) / 2
        return (num_tokens * self.flops_per_token + pairs * self.attention_flops_per_pair) / self.flops_per_s

    def prefers_swap(self, num_blocks: int, num_tokens: int) -> bool:
        """Whether swapping ``num_blocks`` out and in is quicker than recomputing ``num_tokens``."""
        return self.swap_s(num_blocks) < self.recompute_s(num_tokens)
