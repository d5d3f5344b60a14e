"""A synchronous engine that never has work: enough to build the server app for routes that do not
generate (auth, documents, metrics)."""

from __future__ import annotations

from typing import Any

from pagedllm.engine.observe.stats import EngineStats


class IdleEngine:
    model_name = "idle"
    max_model_len = 64
    vocab_size = 256
    tokenizer = None

    def add_request(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError("this engine takes no requests")

    def step(self) -> list[Any]:
        return []

    def abort_request(self, request_id: Any) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return False

    def pop_token_intervals(self) -> list[float]:
        return []

    def get_stats(self) -> EngineStats:
        return EngineStats()
