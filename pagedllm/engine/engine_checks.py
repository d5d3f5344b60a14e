"""Checks of engine options and request fields made before anything is queued or started; each error
names the field (a :class:`~pagedllm.errors.RequestError` for a request's)."""

from __future__ import annotations

from collections.abc import Container

from pagedllm.config import EngineConfig
from pagedllm.errors import RequestError
from pagedllm.spec.config import SpeculativeConfig, parse_speculative_config

# What a msgpack integer carries: a priority outside this range cannot reach an engine-core process.
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1


def check_wire_priority(priority: object) -> None:
    """Raise :class:`RequestError` naming ``priority`` unless it is an integer (not a boolean) that a
    message to an engine-core process can carry (64 bits)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise RequestError("priority", f"priority must be an integer, got {priority!r}.")
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise RequestError(
            "priority",
            f"priority must be a 64-bit integer ({PRIORITY_MIN} to {PRIORITY_MAX}), got {priority}.",
        )


def check_priority(priority: object, policy: str, *, wire: bool = True) -> None:
    """Raise :class:`RequestError` naming ``priority`` unless it is an integer that the scheduling
    policy takes (any under ``priority``, only 0 under ``fcfs``) and, with ``wire``, that a message to
    an engine-core process can carry (every front-end checks so; an engine in this process takes any
    integer). The one check of a request's priority, wherever a request comes in."""
    if wire:
        check_wire_priority(priority)
    elif not isinstance(priority, int) or isinstance(priority, bool):
        raise RequestError("priority", f"priority must be an integer, got {priority!r}.")
    if priority != 0 and policy != "priority":
        raise RequestError(
            "priority",
            f"priority {priority}: requests have priorities under scheduling_policy 'priority' only "
            f"(this engine runs {policy!r}; start it with --scheduling-policy priority).",
        )


def check_new_request_id(request_id: str, in_use: Container[str]) -> None:
    """Raise :class:`RequestError` naming ``request_id`` when a request of that id is in flight
    (``in_use``): the one check of a reused id, in every place that keys requests by it."""
    if request_id in in_use:
        raise RequestError("request_id", f"request_id {request_id!r} is already in use.")


def check_sequence_ids(request_id: str, sequence_ids: list[str], in_use: Container[str]) -> None:
    """Raise :class:`RequestError` naming ``request_id`` when one of its sequence ids (the request id,
    or ``{i}_{request_id}`` for n > 1) is another request's: "0_X" of a request "X" with n = 2 and a
    request "0_X" would collide."""
    taken = [sid for sid in sequence_ids if sid in in_use]
    if taken:
        raise RequestError(
            "request_id", f"request_id {request_id!r}: sequence id {taken[0]!r} is already in use."
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


# The step-time target where ``max_step_time_ms`` is unset, by device type (chosen from `pagedllm bench
# step-time`: the CPU's 500 ms keeps a long prompt's first token within 1.3x of the token budget's and
# its neighbours' gaps under 1.5 targets; see docs/PERFORMANCE.md §18). On a CPU a step of
# ``max_num_batched_tokens`` prompt tokens takes seconds, which every running stream waits out; on a
# GPU such a step takes milliseconds, and the token budget alone is right.
DEFAULT_MAX_STEP_TIME_MS = {"cpu": 500.0}


def resolve_step_time(
    config: EngineConfig, task: str, device_type: str, interleaved_steps: int
) -> float | None:
    """The step-time target in seconds (None: off), from ``max_step_time_ms``: unset means the
    device's default (500 ms on CPU, off elsewhere), 0 means off. ValueError, naming the field, where
    a target was asked for and cannot apply: task 'embed' (a prompt is pooled whole, in one step) and
    pipeline stages running interleaved steps (their steps overlap)."""
    ms = config.max_step_time_ms
    if ms is None:
        ms = (
            DEFAULT_MAX_STEP_TIME_MS.get(device_type, 0.0)
            if task == "generate" and interleaved_steps == 1
            else 0.0
        )
    elif ms and task != "generate":
        raise ValueError(
            f"max_step_time_ms does not apply to task {task!r}: a prompt is pooled whole, in one step "
            "(set 0 or leave it unset)."
        )
    elif ms and interleaved_steps > 1:
        raise ValueError(
            "max_step_time_ms does not apply with pipeline stages running interleaved steps "
            "(pipeline_parallel_size > 1 with async scheduling): set 0, leave it unset, or turn "
            "async_scheduling off."
        )
    return ms / 1000.0 if ms else None
