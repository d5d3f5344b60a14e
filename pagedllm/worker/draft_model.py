"""Draft-model speculation: a second, smaller model proposes the drafts. Placeholder."""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.request import Request
from pagedllm.spec.config import SpeculativeConfig
from pagedllm.worker.executor import Executor


class DraftModelProposer:
    """Proposes drafts with a draft model that shares the target's tokenizer."""

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, target: Executor) -> None:
        raise ValueError("speculative_config.model: draft-model speculation is not available yet.")

    def propose_all(self, requests: list[Request]) -> None:
        raise NotImplementedError

    def check_idle(self) -> None:
        raise NotImplementedError
