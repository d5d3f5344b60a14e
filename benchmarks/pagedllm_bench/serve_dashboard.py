"""``pagedllm bench serve --poll-dashboard HZ``: the cost of an open dashboard, measured in one run.

The workload runs in alternating rounds against the same server, without and then with a client
that acts as an open page: it reads ``/v1/engine/state`` (the KV block map, the requests) ``HZ``
times a second and keeps ``/v1/engine/events`` (the step stream) open. The report is each side's
median output tok/s over the rounds and their ratio (with / without).
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from pagedllm_bench.serve_report import summarize


@dataclass
class DashboardComparison:
    """Output throughput of the same workload without and with a polling page."""

    without_tok_s: list[float]  # output tok/s of each round without a page
    with_tok_s: list[float]  # output tok/s of each round with a page polling
    polls: int  # snapshots the page read in all
    step_events: int  # event-stream messages the page received in all

    @property
    def ratio(self) -> float:
        """Median with a page / median without (1.0: no cost)."""
        return statistics.median(self.with_tok_s) / max(statistics.median(self.without_tok_s), 1e-9)


class DashboardPoller:
    """A client that reads the dashboard's data as an open page does, until stopped."""

    def __init__(self, base_url: str, api_key: str | None, hz: float) -> None:
        if not hz > 0:
            raise ValueError(f"--poll-dashboard must be positive, got {hz}.")
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.period = 1.0 / hz
        self.polls = 0
        self.events = 0

    async def _poll_state(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        since = 0
        while not stop.is_set():
            r = await client.get(f"{self.base_url}/v1/engine/state", params={"since": since, "steps": 1024})
            r.raise_for_status()
            steps = r.json()["steps"]
            since = steps[-1]["step"] if steps else since
            self.polls += 1
            try:
                await asyncio.wait_for(stop.wait(), self.period)
            except TimeoutError:
                pass

    async def _read_events(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        async with client.stream("GET", f"{self.base_url}/v1/engine/events") as events:
            events.raise_for_status()
            async for line in events.aiter_lines():
                self.events += line.startswith("data: ")
                if stop.is_set():
                    return

    async def run(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(headers=self.headers, timeout=60.0) as client:
            tasks = [
                asyncio.create_task(self._poll_state(client, stop)),
                asyncio.create_task(self._read_events(client, stop)),
            ]
            await stop.wait()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _one_round(
    benchmark: Callable[[], Awaitable[tuple[list[Any], float, str]]], poller: DashboardPoller | None
) -> float:
    stop = asyncio.Event()
    watcher = asyncio.create_task(poller.run(stop)) if poller is not None else None
    try:
        results, duration, _ = await benchmark()
    finally:
        stop.set()
        if watcher is not None:
            await watcher
    return float(summarize(results, duration, {})["output_throughput"])


def compare_with_dashboard(
    benchmark: Callable[[], Awaitable[tuple[list[Any], float, str]]],
    base_url: str,
    api_key: str | None,
    hz: float,
    rounds: int = 2,
) -> DashboardComparison:
    """Run ``benchmark`` ``rounds`` times without and with a poller, alternating (without first)."""
    poller = DashboardPoller(base_url, api_key, hz)
    without: list[float] = []
    with_page: list[float] = []
    for _ in range(rounds):
        without.append(asyncio.run(_one_round(benchmark, None)))
        with_page.append(asyncio.run(_one_round(benchmark, poller)))
    return DashboardComparison(without, with_page, poller.polls, poller.events)


def format_comparison(c: DashboardComparison, hz: float) -> str:
    fmt = ", ".join
    return (
        f"Dashboard cost: output tok/s without a page [{fmt(f'{v:.1f}' for v in c.without_tok_s)}], with a page "
        f"polling at {hz:g} Hz and the event stream open [{fmt(f'{v:.1f}' for v in c.with_tok_s)}]; "
        f"median ratio {c.ratio:.3f} ({c.polls} snapshots, {c.step_events} event messages read)"
    )
