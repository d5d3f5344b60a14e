"""A bounded record of the engine's latest steps, filled at the end of every step (the dashboard's
data). Placeholder: records nothing yet."""

from __future__ import annotations

from typing import Any

from pagedllm.core.scheduler import SchedulerOutput


class StepEvents:
    """The latest steps of one engine."""

    def record(self, scheduler_output: SchedulerOutput, engine: Any, duration_s: float) -> None:
        """Called by the engine once per launched step, after the scheduler's update."""
