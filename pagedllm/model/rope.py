"""RoPE scaling schemes: the inverse frequencies and attention factor of each Hugging Face rope type.

A scaling dict is the ``rope_scaling`` of :class:`pagedllm.model.config.ModelConfig`: a ``rope_type``
key and that scheme's parameters, with the values Hugging Face derives from the rest of the config
already filled in by the config loader (``original_max_position_embeddings``, a missing ``factor``).
Every scheme gives per-frequency inverse frequencies (``head_dim / 2`` of them, float64) and one
attention factor that multiplies both cos and sin; :class:`pagedllm.model.layers.RotaryEmbedding`
folds that factor into its cached tables, so rotating with them needs nothing scheme-specific.

The formulas are transformers' (``modeling_rope_utils``), computed in float64. Where transformers
chooses frequencies by the current sequence length, a paged engine cannot (cached K/V and shared
prefix blocks were rotated once and must stay valid), so the choice is made once from the table
length ``max_position`` (the engine's ``max_model_len``):

- ``longrope``: the long factors for every position when ``max_position`` exceeds
  ``original_max_position_embeddings``, else the short factors (vLLM's rule). This equals
  transformers whenever its own choice is the same for the whole sequence: every sequence within
  the original length with a short table, and prompts longer than the original length with a long
  table; a sequence that starts short and grows past the original length with a long table is
  rotated with the long factors throughout (transformers switches, recomputing the cache).
- ``dynamic`` (NTK): the base is stretched for a sequence of ``max_position`` tokens when that
  exceeds ``original_max_position_embeddings`` (the config's ``max_position_embeddings``), else
  plain RoPE, which is what transformers computes for every sequence within that length.

Parameters a scheme does not use are a ValueError naming them (they would change results in some
other implementation, or signal a scheme this engine does not know), except the descriptive
``original_max_position_embeddings`` and a ``partial_rotary_factor`` of 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

# rope_type -> (required keys, optional keys), besides "rope_type" itself.
_KEYS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "default": (frozenset(), frozenset()),
    "linear": (frozenset({"factor"}), frozenset()),
    "dynamic": (frozenset({"factor", "original_max_position_embeddings"}), frozenset()),
    "llama3": (
        frozenset({"factor", "original_max_position_embeddings"}),
        frozenset({"low_freq_factor", "high_freq_factor"}),
    ),
    "yarn": (
        frozenset({"factor", "original_max_position_embeddings"}),
        frozenset({"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
    ),
    "longrope": (
        frozenset({"short_factor", "long_factor", "original_max_position_embeddings", "factor"}),
        frozenset({"attention_factor"}),
    ),
}

ROPE_TYPES: tuple[str, ...] = tuple(_KEYS)

# Keys any scheme may carry without effect on the result.
_DESCRIPTIVE = frozenset({"rope_type", "original_max_position_embeddings"})


@dataclass(frozen=True)
class RopeFrequencies:
    """``inv_freq`` (``[head_dim / 2]`` float64) and the factor multiplying cos and sin."""

    inv_freq: torch.Tensor
    attention_factor: float


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    """The scheme a scaling dict names ("default" for None or an empty dict)."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def validate_rope_scaling(scaling: dict[str, Any] | None, head_dim: int) -> None:
    """Raise ValueError unless ``scaling`` is a scheme this engine computes, with the keys it uses.

    Names the unknown rope type, the missing keys or the keys the scheme would ignore.
    """
    rope_type = rope_type_of(scaling)
    if rope_type not in _KEYS:
        raise ValueError(f"Unsupported rope scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}.")
    params = {k: v for k, v in (scaling or {}).items() if k != "type"}
    partial = params.pop("partial_rotary_factor", 1.0)
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} (rotating part of each head) is not supported.")
    required, optional = _KEYS[rope_type]
    missing = sorted(k for k in required if params.get(k) is None)
    if missing:
        raise ValueError(f"rope scaling type {rope_type!r} needs {missing}; got {sorted(params)}.")
    unused = sorted(set(params) - required - optional - _DESCRIPTIVE)
    if unused:
        raise ValueError(
            f"rope scaling type {rope_type!r} does not use {unused}; refusing to ignore them "
            f"(it takes {sorted(required | optional)})."
        )
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(params[key]) != head_dim // 2:
                n = len(params[key])
                raise ValueError(
                    f"longrope {key} has {n} entries; head_dim {head_dim} needs {head_dim // 2}."
                )


def _plain_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor = float(p["factor"])
    low = float(p.get("low_freq_factor", 1.0))
    high = float(p.get("high_freq_factor", 4.0))
    old_len = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(head_dim: int, base: float, p: dict[str, Any]) -> RopeFrequencies:
    factor = float(p["factor"])
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:  # transformers uses them only as a pair (DeepSeek style)
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    # A zero or missing beta means the paper's default, as in transformers.
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1
    original = float(p["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        """The frequency index that turns ``rotations`` times over the original context."""
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = _plain_inv_freq(head_dim, base)
    interpolation = extrapolation / factor
    # Fast-turning frequencies keep their values; slow ones are interpolated; a ramp in between.
    inv_freq = interpolation * ramp + extrapolation * (1 - ramp)
    return RopeFrequencies(inv_freq, float(attention_factor))


def _longrope(head_dim: int, base: float, p: dict[str, Any], max_position: int) -> RopeFrequencies:
    original = int(p["original_max_position_embeddings"])
    factor = float(p["factor"])
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = p["long_factor"] if max_position > original else p["short_factor"]
    ext_factors = torch.tensor([float(x) for x in ext], dtype=torch.float64)
    return RopeFrequencies(_plain_inv_freq(head_dim, base) / ext_factors, float(attention_factor))


def _dynamic(head_dim: int, base: float, p: dict[str, Any], max_position: int) -> torch.Tensor:
    original = int(p["original_max_position_embeddings"])
    factor = float(p["factor"])
    seq_len = max(max_position, original)
    base = base * ((factor * seq_len / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return _plain_inv_freq(head_dim, base)


def rope_frequencies(
    head_dim: int, base: float, scaling: dict[str, Any] | None, max_position: int
) -> RopeFrequencies:
    """The inverse frequencies and attention factor of ``scaling`` for a table of ``max_position``
    positions (which only ``longrope`` and ``dynamic`` read; see the module docstring)."""
    validate_rope_scaling(scaling, head_dim)
    rope_type = rope_type_of(scaling)
    p = scaling or {}
    if rope_type == "yarn":
        return _yarn(head_dim, base, p)
    if rope_type == "longrope":
        return _longrope(head_dim, base, p, max_position)
    if rope_type == "dynamic":
        return RopeFrequencies(_dynamic(head_dim, base, p, max_position), 1.0)
    inv_freq = _plain_inv_freq(head_dim, base)
    if rope_type == "llama3":
        inv_freq = _llama3(inv_freq, p)
    elif rope_type == "linear":
        inv_freq = inv_freq / float(p["factor"])
    return RopeFrequencies(inv_freq, 1.0)
