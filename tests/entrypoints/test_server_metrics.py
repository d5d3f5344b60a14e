"""What ``/metrics`` counts, against a real ``pagedllm serve`` process (engine-core processes) and
the official ``openai`` client: the series named as vLLM's mean what vLLM's mean (a request counts
once whatever its ``n``; ``prompt_tokens_total`` counts every prompt token, prefix-cache hits
included), the series of our own count the rest (sequences, computed prompt tokens), and time to
first token never exceeds the request's own latency."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.server import SMALL_ENGINE_ARGS, RemoteServer

MODEL = "metrics-model"


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    with RemoteServer([*SMALL_ENGINE_ARGS, "--served-model-name", MODEL]) as srv:
        yield srv
        srv.wait_idle()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client(timeout=120.0)


def _series(server: RemoteServer) -> dict[tuple[str, str], float]:
    """Each sample by (name, its ``finished_reason`` or ``source`` label, "" if none), summed over
    engines."""
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for s in family.samples:
            key = (s.name, s.labels.get("finished_reason") or s.labels.get("source") or "")
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


def _total(series: dict[tuple[str, str], float], name: str) -> float:
    return sum(v for (n, _), v in series.items() if n == name)


def _settled(
    server: RemoteServer, before: dict[tuple[str, str], float], **at_least: float
) -> dict[str, float]:
    """Wait until each named total has grown by at least the given amount (the engine's counters come
    with its stats, a moment after the outputs); returns every total's growth."""
    deadline = time.monotonic() + 30
    while True:
        after = _series(server)
        grown = {n: _total(after, n) - _total(before, n) for n in {n for n, _ in after}}
        if all(grown.get(n, 0.0) >= v for n, v in at_least.items()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for (n, label), v in after.items():
        grown[f"{n}[{label}]"] = v - before.get((n, label), 0.0)
    return grown


def test_a_request_with_n_2_counts_once(server: RemoteServer, client: openai.OpenAI) -> None:
    server.wait_idle()
    before = _series(server)
    out = client.completions.create(
        model=MODEL,
        prompt="Name two colours of the evening sky:",
        n=2,
        max_tokens=3,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert out.usage is not None and out.usage.completion_tokens == 6 and len(out.choices) == 2
    prompt_len = out.usage.prompt_tokens
    grown = _settled(
        server,
        before,
        **{"pagedllm:prompt_tokens_total": prompt_len, "pagedllm:generation_tokens_total": 6},
    )
    # One request: one success (by its finish reason), one latency, one size of each kind ...
    assert grown["pagedllm:request_success_total"] == 1
    assert grown["pagedllm:request_success_total[length]"] == 1
    assert grown["pagedllm:e2e_request_latency_seconds_count"] == 1
    assert grown["pagedllm:time_to_first_token_seconds_count"] == 1
    assert grown["pagedllm:request_prompt_tokens_count"] == 1
    assert grown["pagedllm:request_prompt_tokens_sum"] == prompt_len
    assert grown["pagedllm:request_generation_tokens_sum"] == 6
    # ... its prompt counted once, though both sequences read it ...
    assert grown["pagedllm:prompt_tokens_total"] == prompt_len
    assert grown["pagedllm:generation_tokens_total"] == 6
    # ... and two finished sequences, whose own prefill work is counted apart.
    assert grown["pagedllm:sequence_success_total[length]"] == 2
    assert grown["pagedllm:prompt_tokens_computed_total"] >= prompt_len
    server.wait_idle()


def test_prompt_tokens_count_cache_hits_and_computed_tokens_apart(
    server: RemoteServer, client: openai.OpenAI
) -> None:
    prompt = "Inventory: " + ", ".join(f"crate {i} holds {i * 7} bolts" for i in range(24))
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert first.usage is not None and first.usage.prompt_tokens > 64
    server.wait_idle()
    before = _series(server)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    n, cached = again.usage.prompt_tokens, again.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and 64 <= cached < n, (cached, n)  # the first request's full blocks
    grown = _settled(server, before, **{"pagedllm:prompt_tokens_total": n})
    # vLLM's series: every prompt token, split by where it came from.
    assert grown["pagedllm:prompt_tokens_total"] == n
    assert grown["pagedllm:prompt_tokens_cached_total"] == cached
    assert grown["pagedllm:prompt_tokens_by_source_total[local_compute]"] == n - cached
    assert grown["pagedllm:prompt_tokens_by_source_total[local_cache_hit]"] == cached
    assert grown["pagedllm:prompt_tokens_by_source_total[external_kv_transfer]"] == 0
    assert grown["pagedllm:prefix_cache_queries_total"] == n
    assert grown["pagedllm:prefix_cache_hits_total"] == cached
    # Ours: the tokens the model computed.
    assert grown["pagedllm:prompt_tokens_computed_total"] == n - cached
    server.wait_idle()


def test_time_to_first_token_is_within_the_request(server: RemoteServer, client: openai.OpenAI) -> None:
    """A long prompt's first token comes from a long prefill step. The core's token times reach the
    front-end mapped onto its clock; mapped from the step's start instead of the message's sending,
    they came out later than the front-end got them by about that step, and the time to first token
    exceeded the request's own end-to-end latency (and the client's)."""
    prompt = "Ledger: " + "; ".join(f"entry {i} debits {i * 13} and credits {i * 11}" for i in range(60))
    server.wait_idle()
    before = _series(server)
    started = time.monotonic()
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    elapsed = time.monotonic() - started
    assert out.usage is not None and out.usage.prompt_tokens > 600
    grown = _settled(server, before, **{"pagedllm:time_to_first_token_seconds_count": 1})
    assert grown["pagedllm:time_to_first_token_seconds_count"] == 1
    ttft, e2e = (
        grown["pagedllm:time_to_first_token_seconds_sum"],
        grown["pagedllm:e2e_request_latency_seconds_sum"],
    )
    assert 0 < ttft <= e2e < elapsed, (ttft, e2e, elapsed)
    server.wait_idle()
