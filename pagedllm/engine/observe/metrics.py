"""Prometheus metrics of the serving engine and a periodic throughput log line.

Every metric lives in the ``CollectorRegistry`` of its :class:`EngineMetrics`, so several engines (or
tests) in one process never collide, and all names carry the ``pagedllm:`` prefix. Gauges and the
token/preemption/prefix-cache counters are fed from :class:`~pagedllm.engine.observe.stats.EngineStats`
snapshots (counters advance by the difference to the previous snapshot); per-request latencies,
sizes and finish counts are observed by the async engine (:meth:`EngineMetrics.observe_output`) from
its own timestamps.

Series named as vLLM's mean what vLLM's mean, so that its dashboards read them right: a request is
what a client sent (its ``n`` sequences count once: ``request_success_total``, the request
histograms), ``prompt_tokens_total`` counts every prompt token of a request, prefix-cache hits
included, split by ``prompt_tokens_by_source_total`` and ``prompt_tokens_cached_total``; the
series of our own (``prompt_tokens_computed_total``, ``sequence_success_total``) count the engine's
prefill work and each sequence. Time to first token runs from the request's arrival at the front-end
to the engine's first token, both on the front-end's clock, so it never exceeds what the client sees.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from pagedllm.engine.observe.stats import EngineStats
from pagedllm.outputs import EmbeddingRequestOutput, RequestOutput

logger = logging.getLogger(__name__)

PREFIX = "pagedllm:"

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

# Token counts of one request: 1, 2, 5, 10, 20, 50, ... up to 5 million (vLLM's 1-2-5 series).
_TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))
# vLLM's prompt-token sources; this engine has no external KV transfer (always 0).
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Where front-end processes write their metrics for each other (set before prometheus_client loads).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


@dataclass
class RequestTimes:
    """A request's times on its front-end's clock (``time.monotonic``): its arrival (when the
    front-end hands it to the engine, after reading and tokenizing it) and its first token's."""

    arrival: float
    first_token_time: float | None = None
    num_prompt_tokens: int = 0  # when known at submission (an output may not carry its prompt)
    # For a request whose outputs are deltas: its generated tokens and its sequences' finish
    # reasons so far (index -> reason), which its final output alone does not hold.
    delta: bool = False
    num_generation_tokens: int = 0
    finish_reasons: dict[int, str | None] = dataclass_field(default_factory=dict)


class EngineMetrics:
    """The engine's Prometheus metrics, labelled with the served model name."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry

        # Engine state, one series per engine core (label ``engine``: its data-parallel rank).
        per_engine = labels + ["engine"]
        # Several front-end processes (--api-server-count) share their metrics through
        # prometheus_client's multi-process files; only front-end 0 sets the engine gauges.
        self._num_requests_running = Gauge(
            PREFIX + "num_requests_running",
            "Number of requests in the running batch.",
            per_engine,
            registry=reg,
            multiprocess_mode="mostrecent",
        )
        self._num_requests_waiting = Gauge(
            PREFIX + "num_requests_waiting",
            "Number of requests waiting to be scheduled.",
            per_engine,
            registry=reg,
            multiprocess_mode="mostrecent",
        )
        self._kv_cache_usage_perc = Gauge(
            PREFIX + "kv_cache_usage_perc",
            "Fraction of KV-cache blocks held by requests (1 = full).",
            per_engine,
            registry=reg,
            multiprocess_mode="mostrecent",
        )
        self._num_requests_swapped = Gauge(
            PREFIX + "num_requests_swapped",
            "Number of requests swapped out to the host tier of the KV cache.",
            per_engine,
            registry=reg,
            multiprocess_mode="mostrecent",
        )
        self._host_kv_usage_perc = Gauge(
            PREFIX + "host_kv_cache_usage_perc",
            "Fraction of the host tier's KV blocks in use by swapped requests (0 without a host tier).",
            per_engine,
            registry=reg,
            multiprocess_mode="mostrecent",
        )
        # Counters fed from the EngineStats field named first: each advances by that total's change.
        self._counters = {
            field: Counter(PREFIX + name, doc, per_engine, registry=reg)
            for field, name, doc in (
                (
                    "prompt_tokens",
                    "prompt_tokens",
                    "Prompt tokens of requests whose prefill completed, prefix-cache hits included "
                    "(once per request, whatever its n).",
                ),
                (
                    "prompt_tokens_cached",
                    "prompt_tokens_cached",
                    "Of prompt_tokens, those found in the prefix cache (device or host tier).",
                ),
                (
                    "prompt_tokens_computed",
                    "prompt_tokens_computed",
                    "Prompt tokens run through the model (prefill), recomputation after preemption and "
                    "each of n sequences' own prefill included.",
                ),
                ("generation_tokens", "generation_tokens", "Tokens generated."),
                ("num_preemptions", "num_preemptions", "Requests preempted to free KV-cache blocks."),
                (
                    "prefix_cache_queries",
                    "prefix_cache_queries",
                    "Prompt tokens looked up in the prefix cache.",
                ),
                ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
                (
                    "spec_drafts",
                    "spec_decode_num_drafts",
                    "Speculative decoding: request steps that verified draft tokens.",
                ),
                (
                    "spec_draft_tokens",
                    "spec_decode_num_draft_tokens",
                    "Speculative decoding: draft tokens verified by the model.",
                ),
                (
                    "spec_accepted_tokens",
                    "spec_decode_num_accepted_tokens",
                    "Speculative decoding: draft tokens accepted (the acceptance rate is their ratio to the "
                    "drafts).",
                ),
                (
                    "swapped_out",
                    "num_swapped_out",
                    "Requests preempted by swapping their KV to the host tier.",
                ),
                ("swapped_in", "num_swapped_in", "Swapped requests brought back to the device."),
                ("swap_out_bytes", "swap_out_bytes", "KV bytes copied from the device to the host tier."),
                ("swap_in_bytes", "swap_in_bytes", "KV bytes copied from the host tier to the device."),
                (
                    "host_prefix_cache_hits",
                    "host_prefix_cache_hits",
                    "Prompt tokens found in the host tier's prefix cache (also counted in prefix_cache_hits).",
                ),
            )
        }
        self._prompt_tokens_by_source = Counter(
            PREFIX + "prompt_tokens_by_source",
            "Prompt tokens of requests by source: computed here (local_compute), found in the prefix "
            "cache (local_cache_hit) or transferred (external_kv_transfer, always 0 here).",
            per_engine + ["source"],
            registry=reg,
        )
        self._num_engines_alive = Gauge(
            PREFIX + "num_engines_alive",
            "Engine cores serving (data parallel: up to its size).",
            labels,
            registry=reg,
            multiprocess_mode="mostrecent",
        ).labels(model_name)
        self._request_success = Counter(
            PREFIX + "request_success",
            "Finished requests, once per request (n > 1 included), by the finish reason of its first "
            "sequence.",
            labels + ["finished_reason"],
            registry=reg,
        )
        self._sequence_success = Counter(
            PREFIX + "sequence_success",
            "Finished sequences (each of a request's n completions), by finish reason.",
            labels + ["finished_reason"],
            registry=reg,
        )
        for reason in ("stop", "length", "abort"):
            self._request_success.labels(model_name, reason)
            self._sequence_success.labels(model_name, reason)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        self.request_prompt_tokens = histogram(
            "request_prompt_tokens",
            "Prompt tokens of each finished request, prefix-cache hits included.",
            _TOKEN_COUNT_BUCKETS,
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens",
            "Tokens generated for each finished request (all of its n sequences).",
            _TOKEN_COUNT_BUCKETS,
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds",
            "Time from the request's arrival at the front-end to its first generated token.",
            _LATENCY_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Time between successive tokens of a sequence, as the engine produced them.",
            _ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds",
            "Time from arrival to the end of a finished request.",
            _REQUEST_BUCKETS,
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Time a request waited before it was first scheduled.",
            _REQUEST_BUCKETS,
        )

        self._last_stats: dict[str, EngineStats] = {}
        self.register_engines(["0"])

    def register_engines(self, engines: list[str]) -> None:
        """Create the series of these engine cores (at zero), so that they exist before any change."""
        name = self.model_name
        for engine in engines:
            for family in (
                self._num_requests_running,
                self._num_requests_waiting,
                self._kv_cache_usage_perc,
                self._num_requests_swapped,
                self._host_kv_usage_perc,
                *self._counters.values(),
            ):
                family.labels(name, engine)
            for source in PROMPT_TOKEN_SOURCES:
                self._prompt_tokens_by_source.labels(name, engine, source)

    def record_stats(self, stats: EngineStats, engine: str = "0") -> None:
        """Set an engine core's gauges and advance its counters by the change since its previous
        snapshot."""
        name = self.model_name
        self._num_requests_running.labels(name, engine).set(stats.num_running)
        self._num_requests_waiting.labels(name, engine).set(stats.num_waiting)
        self._kv_cache_usage_perc.labels(name, engine).set(stats.kv_cache_usage)
        self._num_requests_swapped.labels(name, engine).set(stats.num_swapped)
        host_used = stats.num_host_blocks - stats.num_free_host_blocks
        self._host_kv_usage_perc.labels(name, engine).set(
            host_used / stats.num_host_blocks if host_used else 0.0
        )
        last = self._last_stats.get(engine) or EngineStats()
        for field, counter in self._counters.items():
            new, old = getattr(stats, field), getattr(last, field)
            if new > old:
                counter.labels(name, engine).inc(new - old)
        by_source = self._prompt_tokens_by_source
        computed = (stats.prompt_tokens - stats.prompt_tokens_cached) - (
            last.prompt_tokens - last.prompt_tokens_cached
        )
        if computed > 0:
            by_source.labels(name, engine, "local_compute").inc(computed)
        if stats.prompt_tokens_cached > last.prompt_tokens_cached:
            by_source.labels(name, engine, "local_cache_hit").inc(
                stats.prompt_tokens_cached - last.prompt_tokens_cached
            )
        self._last_stats[engine] = stats

    def clear_engine(self, engine: str) -> None:
        """An engine core is gone: its gauges read zero (its counters keep their totals)."""
        name = self.model_name
        for gauge in (
            self._num_requests_running,
            self._num_requests_waiting,
            self._kv_cache_usage_perc,
            self._num_requests_swapped,
            self._host_kv_usage_perc,
        ):
            gauge.labels(name, engine).set(0)

    def set_engines_alive(self, n: int) -> None:
        self._num_engines_alive.set(n)

    def observe_output(
        self, times: RequestTimes, out: RequestOutput | EmbeddingRequestOutput, now: float
    ) -> None:
        """Observe one output of a request (``now``: when the front-end got it): its time to first
        token on the first output that has one and, once it is finished, its end-to-end latency,
        queue time, sizes and finish (one request, and each of its sequences).

        An embedding counts as one finished sequence, its time as that of a first token. The engine's
        times are on the front-end's clock already (see ``metrics_from_times``).
        """
        m = out.metrics
        completions = out.outputs if isinstance(out, RequestOutput) else []
        if times.first_token_time is None:
            # The engine's time of the first token (an output may come only at the end).
            first = m.first_token_time if m is not None else None
            if first is None and any(c.token_ids for c in completions):
                first = now
            if first is not None:
                times.first_token_time = first
                self.time_to_first_token.observe(max(0.0, first - times.arrival))
        if times.delta:
            times.num_generation_tokens += sum(len(c.token_ids) for c in completions)
            for c in completions:
                if c.finish_reason is not None:
                    times.finish_reasons[c.index] = c.finish_reason
        if not out.finished:
            return
        self.e2e_request_latency.observe(now - times.arrival)
        if m is not None and m.first_scheduled_time is not None:
            self.request_queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        elif times.first_token_time is not None:
            self.request_queue_time.observe(max(0.0, times.first_token_time - times.arrival))
        self.request_prompt_tokens.observe(len(out.prompt_token_ids) or times.num_prompt_tokens)
        if times.delta:
            self.request_generation_tokens.observe(times.num_generation_tokens)
            reasons = [times.finish_reasons[i] for i in sorted(times.finish_reasons)] or ["stop"]
        else:
            self.request_generation_tokens.observe(sum(len(c.token_ids) for c in completions))
            reasons = [c.finish_reason for c in sorted(completions, key=lambda c: c.index)] or ["stop"]
        name = self.model_name
        self._request_success.labels(name, reasons[0] or "unknown").inc()
        for reason in reasons:
            self._sequence_success.labels(name, reason or "unknown").inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (of every front-end process when they
        share multi-process files: ``PROMETHEUS_MULTIPROC_DIR``)."""
        if os.environ.get(MULTIPROC_ENV):
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)


class StatLogger:
    """Logs throughput, queue and cache state at most once per ``interval`` seconds."""

    def __init__(self, interval: float = 5.0, log: logging.Logger | None = None) -> None:
        self.interval = interval
        self._log = log or logger
        self._last_time = time.monotonic()
        self._last = EngineStats()

    def maybe_log(self, stats: EngineStats, now: float | None = None) -> bool:
        """Log one line if ``interval`` has passed since the previous one; returns whether it logged."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._last_time
        if elapsed < self.interval:
            return False
        last = self._last
        prompt_tput = (stats.prompt_tokens - last.prompt_tokens) / elapsed
        gen_tput = (stats.generation_tokens - last.generation_tokens) / elapsed
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        hit_rate = 100.0 * hits / queries if queries > 0 else 0.0
        self._log.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            prompt_tput,
            gen_tput,
            stats.num_running,
            stats.num_waiting,
            100.0 * stats.kv_cache_usage,
            hit_rate,
        )
        self._last_time = now
        self._last = stats
        return True

    def reset(self, stats: EngineStats, now: float | None = None) -> None:
        """Start a new interval at ``now`` (used when the engine wakes from idle)."""
        self._last_time = time.monotonic() if now is None else now
        self._last = stats
