"""Which model class runs each architecture of :data:`pagedllm.model.config.SUPPORTED_ARCHITECTURES`.

A model class takes ``(config, max_position)``, is built on the meta device and materialised by the
model runner, and provides ``forward(input_ids, positions, ctx)``, ``compute_logits(hidden, out)``,
``load_weights(weights)`` and ``init_rotary(max_position)`` (rotary tables are buffers, not
checkpoint tensors, so the runner rebuilds them after materialising the module).
"""

from __future__ import annotations

from pagedllm.model.config import ModelConfig
from pagedllm.model.gemma import GemmaForCausalLM
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.moe import MoeForCausalLM

# Architecture name -> model class; architectures not listed run on LlamaForCausalLM.
_MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "gemma2": GemmaForCausalLM,
    "gemma3": GemmaForCausalLM,
    "mixtral": MoeForCausalLM,
    "qwen2_moe": MoeForCausalLM,
    "qwen3_moe": MoeForCausalLM,
}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The model class (a :class:`LlamaForCausalLM` or a subclass) that runs ``config``'s architecture."""
    return _MODEL_CLASSES.get(config.architecture, LlamaForCausalLM)
