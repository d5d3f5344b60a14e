"""Next-token sampling: logits processors, filters and the batched :class:`Sampler`."""

from pagedllm.sample.penalties import apply_penalties, token_counts
from pagedllm.sample.sampler import (
    SampledBatch,
    Sampler,
    SamplerOutput,
    SamplingBatch,
    apply_logits_processors,
    exponential_noise,
    filter_thresholds,
    make_generator,
)

__all__ = [
    "SampledBatch",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "apply_logits_processors",
    "apply_penalties",
    "exponential_noise",
    "filter_thresholds",
    "make_generator",
    "token_counts",
]
