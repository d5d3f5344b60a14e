"""A snapshot of engine state and counters, read by metrics and logging."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """Gauges are current values; counters are totals since the engine started."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks held by requests, in [0, 1]
    num_kv_blocks: int = 0
    num_free_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    # Prompt tokens of the requests whose prefill completed, once per request (not per sequence of
    # n > 1), prefix-cache hits included: vLLM's prompt_tokens_total. Counted at the request's first
    # token (an embedding request's at its pooling step).
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0  # of those, found in the prefix cache (device or host tier)
    # Prompt tokens run through the model (prefill chunks), recomputation after preemption and every
    # sequence's own prefill included: the engine's prefill work.
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0  # tokens generated, total
    spec_drafts: int = 0  # speculative decoding: request steps that verified drafts, total
    spec_draft_tokens: int = 0  # draft tokens verified, total
    spec_accepted_tokens: int = 0  # of those, accepted by the target model
    num_swapped: int = 0  # requests swapped out to the host tier now
    num_host_blocks: int = 0  # blocks of the host tier (0: none)
    num_free_host_blocks: int = 0
    swapped_out: int = 0  # requests preempted by swapping out, total
    swapped_in: int = 0  # requests brought back from the host tier, total
    swap_out_bytes: int = 0  # KV bytes copied device -> host (swaps and evictions kept), total
    swap_in_bytes: int = 0  # KV bytes copied host -> device (swaps in, host prefix hits), total
    host_prefix_cache_hits: int = 0  # prompt tokens found in the host tier's prefix cache, total
