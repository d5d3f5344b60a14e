"""Speculative decoding: its configuration, the prompt-lookup proposer and the verification of
proposed tokens (greedy matching and rejection sampling)."""

from pagedllm.spec.config import SpeculativeConfig, check_draft_vocab, parse_speculative_config
from pagedllm.spec.ngram import propose_ngram, propose_ngram_batch
from pagedllm.spec.rejection import VerifiedTokens, draft_tensor, rejection_sample, verify_greedy

__all__ = [
    "SpeculativeConfig",
    "VerifiedTokens",
    "check_draft_vocab",
    "draft_tensor",
    "parse_speculative_config",
    "propose_ngram",
    "propose_ngram_batch",
    "rejection_sample",
    "verify_greedy",
]
