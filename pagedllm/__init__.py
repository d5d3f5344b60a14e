"""pagedllm: an LLM inference and serving engine with a paged KV cache and continuous batching."""

from pagedllm.entrypoints.llm import LLM
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]
