"""Next-token sampling: logits processors, filters and the batched :class:`Sampler`."""

from pagedllm.sample.logits_processors import apply_logits_processors
from pagedllm.sample.penalties import apply_penalties, token_counts
from pagedllm.sample.sampler import (
    DeviceSamples,
    SampledTokens,
    Sampler,
    exponential_noise,
    filter_thresholds,
    make_generator,
)
from pagedllm.sample.sampling_inputs import SamplingInputs

__all__ = [
    "DeviceSamples",
    "Sampler",
    "SampledTokens",
    "SamplingInputs",
    "apply_logits_processors",
    "apply_penalties",
    "exponential_noise",
    "filter_thresholds",
    "make_generator",
    "token_counts",
]
