"""Host time per phase of an engine step, filled by the engine and the model runner."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepPhaseTimes:
    """Host wall-clock seconds spent in each phase of :meth:`LLMEngine.step`, summed over steps.

    ``prepare`` builds the batch's input tensors; ``forward`` runs the model and the LM head;
    ``sample`` covers building the sampling batch and the sampler; ``outputs`` the token
    bookkeeping, stop checks, detokenization and output objects; ``record`` the step's entry in
    the engine's step record (the dashboard's). On a GPU these are host times
    (kernels run asynchronously), not device times.
    """

    steps: int = 0
    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    outputs: float = 0.0
    record: float = 0.0
