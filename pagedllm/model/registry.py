"""Which model class runs each architecture of :data:`pagedllm.model.config.SUPPORTED_ARCHITECTURES`.

A model class takes ``(config, max_position)``, is built on the meta device and materialised by the
model runner, and provides ``forward(input_ids, positions, ctx)``, ``compute_logits(hidden, out)``,
``load_weights(weights)`` and ``init_rotary(max_position)`` (rotary tables are buffers, not
checkpoint tensors, so the runner rebuilds them after materialising the module).
"""

from __future__ import annotations

from torch import nn

from pagedllm.model.config import ModelConfig
from pagedllm.model.llama import LlamaForCausalLM

# Architecture name -> model class; architectures not listed run on LlamaForCausalLM.
_MODEL_CLASSES: dict[str, type[nn.Module]] = {}


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The ``nn.Module`` class that runs ``config``'s architecture."""
    return _MODEL_CLASSES.get(config.architecture, LlamaForCausalLM)
