"""Which draft tokens a request verifies in its next step: the cap every proposer applies, and
prompt lookup (the draft-model proposer is ``pagedllm.worker.draft_model``).

A request gets drafts only when every verified position's distribution is known before the step:
nothing its sampling reads depends on its earlier outputs (no penalties, bad words or grammar, and
``min_tokens`` reached: ``Request.can_sample_ahead``), and it asks for no logprobs. The drafts are
capped so that verifying them stays within ``max_model_len`` and every emitted token within
``max_tokens`` (a step emits at most the drafts + 1).
"""

from __future__ import annotations

from typing import Protocol

from pagedllm.request import Request
from pagedllm.spec.config import SpeculativeConfig
from pagedllm.spec.ngram import propose_ngram


def draft_limit(request: Request, k: int, max_model_len: int) -> int:
    """How many draft tokens ``request`` may verify in its next step, at most ``k`` (0: none).

    None for a request whose distribution reads its earlier output (``Request.can_sample_ahead``) or
    that asks for logprobs; otherwise capped so that the step's emitted tokens (the drafts + 1) stay
    within ``max_tokens`` and the verified positions within ``max_model_len``. Every proposer applies
    this cap.
    """
    if not request.can_sample_ahead or request.params.logprobs is not None:
        return 0
    return max(
        0,
        min(
            k,
            request.max_tokens - request.num_output_tokens - 1,
            max_model_len - request.num_tokens - 1,
        ),
    )


class Proposer(Protocol):
    """What the engine asks of a proposer, after each step, for the requests that go on."""

    def propose_all(self, requests: list[Request]) -> list[list[int]]:
        """Each request's draft tokens (possibly none) for its next step, in order: the engine makes
        them the request's ``spec_token_ids`` (a proposer writes no request state)."""

    def check_idle(self) -> None:
        """Assert that no state of finished requests is left (an idle engine's check)."""


class NgramProposer:
    """Drafts from the request's own tokens (prompt and output): the continuation of the longest
    earlier match of its last ``prompt_lookup_min .. prompt_lookup_max`` tokens."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        assert config.method == "ngram"
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, request: Request) -> list[int]:
        k = draft_limit(request, self.k, self.max_model_len)
        if k <= 0:
            return []
        return propose_ngram(request.all_token_ids, k, self.min_n, self.max_n)

    def propose_all(self, requests: list[Request]) -> list[list[int]]:
        """The draft tokens of each request (running, its latest token on the host), in order."""
        return [self.propose(request) for request in requests]

    def check_idle(self) -> None:
        """Prompt lookup holds no state between steps."""
