"""The dashboard at the scale it is drawn for: a real server (a tiny random-weight model, so that
10,000 KV blocks fit in memory) with 256 requests running, in headless Chromium. The page must draw
every block and every request. The times of a refresh (fetching the snapshot and redrawing the four
views) and of a redraw alone are printed, as figures, not asserted (run with ``-s`` to read them)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.browser import browser_page
from helpers.model_factory import make_tiny_hf_model
from helpers.server import RemoteServer

KEY = "dashboard-scale-key"
NUM_BLOCKS = 10_000
NUM_REQUESTS = 256
PROMPT_LEN = 300  # 19 blocks each: about half the pool in use once all run


class Streams:
    """NUM_REQUESTS streaming completions on a background event loop, cancelled by :meth:`stop`
    (the server aborts a stream whose client goes away)."""

    def __init__(self, srv: RemoteServer) -> None:
        self.srv = srv
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.task: asyncio.Future[Any]

    async def _one(self, client: httpx.AsyncClient, i: int) -> None:
        body = {
            "model": "tiny",
            "prompt": [100 + (i * 13 + j * 7) % 4000 for j in range(PROMPT_LEN)],
            "max_tokens": 1500,
            "ignore_eos": True,
            "stream": True,
        }
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for _ in r.aiter_lines():
                pass

    async def _all(self) -> None:
        headers = {"Authorization": f"Bearer {KEY}"}
        limits = httpx.Limits(max_connections=NUM_REQUESTS + 8)
        async with httpx.AsyncClient(
            base_url=self.srv.base_url, headers=headers, limits=limits, timeout=300
        ) as c:
            await asyncio.gather(*(self._one(c, i) for i in range(NUM_REQUESTS)))

    def start(self) -> None:
        async def begin() -> None:
            self.task = asyncio.ensure_future(self._all())

        asyncio.run_coroutine_threadsafe(begin(), self.loop).result(timeout=10)

    def stop(self) -> None:
        async def cancel() -> None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)  # the client closes its streams

        asyncio.run_coroutine_threadsafe(cancel(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


@pytest.mark.slow
def test_the_page_draws_ten_thousand_blocks_and_256_running_requests(tmp_path: Path) -> None:
    model = make_tiny_hf_model(tmp_path, "llama", max_position_embeddings=2048)
    args = [model, "--served-model-name", "tiny", "--no-multiprocess", "--max-model-len", "2048"]
    args += ["--num-kv-blocks", str(NUM_BLOCKS), "--max-num-seqs", str(NUM_REQUESTS)]
    with RemoteServer(args, api_key=KEY) as srv, browser_page() as (page, errors):
        streams = Streams(srv)
        streams.start()
        try:
            srv.wait_for_metrics(
                lambda m: m.get("pagedllm:num_requests_running") == NUM_REQUESTS, timeout=240
            )
            page.goto(srv.url(f"/dashboard?key={KEY}"))
            page.wait_for_function(
                f"dashboard.state && dashboard.state.running.length === {NUM_REQUESTS}", timeout=60_000
            )
            page.evaluate("dashboard.paused = true")  # only the timed refreshes draw from now on
            times = [
                page.evaluate(
                    "async () => { const t = performance.now(); await dashboard.refresh(); return performance.now() - t; }"
                )
                for _ in range(5)
            ]
            redraws = [
                page.evaluate(
                    "() => { const t = performance.now(); dashboard.redraw(); return performance.now() - t; }"
                )
                for _ in range(5)
            ]
            drawn = page.evaluate(
                "({cells: dashboard.kv.cells, inUse: dashboard.kv.inUse, rows: dashboard.table.length, "
                "timelineRows: dashboard.timeline.rows.length, steps: dashboard.timeline.steps.length, "
                "engineSteps: dashboard.state.step})"
            )
            page.screenshot(path=str(tmp_path / "dashboard-scale.png"), full_page=True)
        finally:
            streams.stop()
        assert drawn["cells"] == NUM_BLOCKS
        assert drawn["inUse"] >= NUM_REQUESTS * -(-PROMPT_LEN // 16), (
            "every running request's blocks are drawn"
        )
        assert drawn["rows"] >= NUM_REQUESTS and drawn["timelineRows"] >= NUM_REQUESTS
        assert drawn["steps"] == min(64, drawn["engineSteps"]), "the default window of steps"
        assert not errors, errors
        refresh_ms = ", ".join(f"{t:.0f}" for t in sorted(times))
        redraw_ms = ", ".join(f"{t:.0f}" for t in sorted(redraws))
        print(
            f"\nAt {NUM_BLOCKS} blocks and {NUM_REQUESTS} running requests: refresh (snapshot + redraw) "
            f"{refresh_ms} ms; redraw alone {redraw_ms} ms"
        )
        srv.wait_idle(timeout=60)  # the cancelled streams are aborted: no block left in use
