"""Checks of engine options and request fields made before anything is queued or started; each error
is a ValueError naming the field."""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.spec.config import SpeculativeConfig, parse_speculative_config


def check_priority(priority: object, policy: str) -> None:
    """Raise ValueError naming ``priority`` unless it is an integer the policy accepts."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an integer, got {priority!r}.")
    if priority != 0 and policy != "priority":
        raise ValueError(
            f"priority {priority}: requests have priorities under scheduling_policy 'priority' only "
            f"(this engine runs {policy!r}; start it with --scheduling-policy priority)."
        )


def check_speculative(config: EngineConfig, task: str) -> SpeculativeConfig | None:
    """The engine's speculative-decoding configuration (None: off); ValueError, naming the field,
    where it cannot run."""
    spec = parse_speculative_config(config.speculative_config)
    if spec is None:
        return None
    if task != "generate" or config.world_size > 1 or config.nnodes > 1:
        raise ValueError(
            "speculative_config: speculative decoding runs on one rank of a generating model (not with "
            "task 'embed', tensor_parallel_size or pipeline_parallel_size)."
        )
    if config.async_scheduling:
        raise ValueError(
            "speculative_config: async_scheduling cannot be on with speculative decoding (the drafts "
            "follow the latest token, which scheduling ahead does not have yet)."
        )
    return spec
