"""The live dashboard: its auth (the API key, or the cookie the page trades it for, on the dashboard's
routes only), ``--disable-dashboard``, and the page itself in headless Chromium against a real
server while requests run: the KV map's cells, shared prefix blocks, a forced preemption, a request
from the timeline to its finish reason in the table, and no console error."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from helpers.browser import browser_page
from helpers.idle_engine import IdleEngine
from helpers.server import REPO_ROOT, RemoteServer
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.api_server import ServerSettings, build_app
from pagedllm.entrypoints.openai.dashboard_auth import COOKIE_NAME, cookie_token

KEY = "dashboard-test-key"
DASHBOARD_ROUTES = ("/dashboard", "/v1/engine/state", "/v1/engine/events")
SCREENSHOT_ENV = "PAGEDLLM_UPDATE_SCREENSHOTS"
NUM_BLOCKS = 24
BLOCK = 16


def idle_app(**settings: Any) -> TestClient:
    engine = AsyncLLMEngine(IdleEngine())  # type: ignore[arg-type]
    return TestClient(
        build_app(engine, ServerSettings(served_model_names=["idle"], api_keys=(KEY,), **settings))
    )


def test_dashboard_routes_need_the_key_or_its_cookie() -> None:
    with idle_app() as http:
        for path in DASHBOARD_ROUTES:
            assert http.get(path).status_code == 401, path
        page = http.get("/dashboard")
        assert "text/html" in page.headers["content-type"] and 'name="key"' in page.text  # the login form
        assert http.get("/dashboard?key=wrong").status_code == 401
        assert http.post("/dashboard/login", data={"key": "wrong"}).status_code == 401
        assert not http.cookies
        # The key in the address: traded for two path-scoped cookies, then out of the address bar.
        r = http.get(f"/dashboard?key={KEY}", follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/dashboard"
        cookies = r.headers.get_list("set-cookie")
        assert sorted(c.split("; ")[1] for c in cookies) == ["Path=/dashboard", "Path=/v1/engine"]
        assert all("HttpOnly" in c and "SameSite=Strict" in c and KEY not in c for c in cookies)
        page = http.get("/dashboard")
        assert page.status_code == 200 and "dashboard.js" in page.text
        js = http.get("/dashboard/static/dashboard.js")
        assert js.status_code == 200 and "javascript" in js.headers["content-type"]
        assert http.get("/dashboard/static/index.html").status_code == 404
        # The idle engine keeps no step record: past the guard, the route says so.
        assert http.get("/v1/engine/state").status_code == 501
        # The cookie opens nothing else, even when sent where its path does not reach.
        cookie = {"cookie": f"{COOKIE_NAME}={cookie_token(KEY)}"}
        assert http.get("/v1/models", headers=cookie).status_code == 401
    with idle_app() as http:
        r = http.post("/dashboard/login", data={"key": KEY}, follow_redirects=False)
        assert r.status_code == 303 and len(r.headers.get_list("set-cookie")) == 2
        assert http.get("/v1/engine/state", headers={"cookie": f"{COOKIE_NAME}=forged"}).status_code == 401


def test_disable_dashboard_removes_its_routes() -> None:
    with idle_app(disable_dashboard=True) as http:
        bearer = {"Authorization": f"Bearer {KEY}"}
        for path in DASHBOARD_ROUTES:
            assert http.get(path, headers=bearer).status_code == 404, path
        # No cookie route either: the key in the address does not get past the guard.
        assert http.get(f"/dashboard?key={KEY}").status_code == 401
        assert http.post("/dashboard/login", data={"key": KEY}).status_code == 401


def _complete(srv: RemoteServer, prompt: list[int], max_tokens: int, out: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        r = srv.post(
            "/v1/completions",
            json={
                "model": "SmolLM2-135M-Instruct",
                "prompt": prompt,
                "max_tokens": max_tokens,
                "ignore_eos": True,
            },
        )
        out[len(prompt)] = r.json()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _wait(page: Any, expression: str, timeout_s: float = 60.0, polling: float | str = "raf") -> Any:
    return page.wait_for_function(expression, timeout=timeout_s * 1000, polling=polling).json_value()


def _in_use_from_metrics(srv: RemoteServer) -> float:
    return srv.metrics()["pagedllm:kv_cache_usage_perc"] * NUM_BLOCKS


def _tokens(start: int, n: int) -> list[int]:
    return [start + (7 * j) % 2000 for j in range(n)]


def _save(page: Any, tmp_path: Path, name: str) -> Path:
    shot = tmp_path / name
    page.screenshot(path=str(shot), full_page=True)
    if os.environ.get(SCREENSHOT_ENV) == "1":
        target = REPO_ROOT / "docs" / "images" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, target)
    return shot


HAS_PREEMPTED_CELL = (
    "Object.values(dashboard.timeline.cells).some(r => Object.values(r).some(c => c.kind === 'preempted'))"
)


@pytest.mark.slow
def test_dashboard_in_a_browser(tmp_path: Path) -> None:
    args = ["--no-multiprocess", "--max-model-len", "512", "--num-kv-blocks", str(NUM_BLOCKS)]
    args += ["--block-size", str(BLOCK), "--max-num-seqs", "8"]
    results: dict[int, Any] = {}
    with RemoteServer(args, api_key=KEY) as srv, browser_page() as (page, errors):
        page.goto(srv.url("/dashboard"))
        # The login form comes with status 401, which the browser reports; nothing else may.
        assert errors == ["Failed to load resource: the server responded with a status of 401 (Unauthorized)"]
        errors.clear()
        page.fill("input[name=key]", KEY)
        page.click("button[type=submit]")
        _wait(page, "window.dashboard && dashboard.polls > 0 && dashboard.kv.cells > 0")  # drawn from data
        assert page.evaluate("dashboard.kv.cells") == NUM_BLOCKS
        assert page.evaluate("document.querySelectorAll('#kv-legend .swatch').length") == 4

        # A shared prefix: four full blocks computed by the first request, reused by the second (14 + 9
        # of the 24 blocks). They run together for about a second on a quick machine, less than the
        # page's own polling period: the test has the page fetch and draw snapshots back to back
        # (dashboard.refresh) until it has drawn them together.
        prefix = _tokens(1000, 4 * BLOCK)
        threads = [_complete(srv, prefix + [5, 6, 7], 150, results)]
        srv.wait_for_metrics(lambda m: m.get("pagedllm:num_requests_running", 0) >= 1, timeout=30)
        threads.append(_complete(srv, prefix + [8, 9], 130, results))
        # (each check starts a refresh and reads what the refreshes before it drew)
        together = "(dashboard.refresh(), dashboard.kv.maxRef >= 2 && dashboard.kv.maxRef)"
        assert _wait(page, together, polling=50) == 2
        assert page.evaluate("dashboard.kv.shared") >= 4

        # The map's in-use cells: those of the snapshot it drew, and /metrics within one step of it
        # (the page paused, one snapshot fetched and drawn between two reads of /metrics).
        page.click("#pause")
        before = _in_use_from_metrics(srv)
        drawn = page.evaluate("dashboard.refresh().then(kv => kv.inUse)")
        after = _in_use_from_metrics(srv)
        stats = page.evaluate("dashboard.state.stats")
        running = page.evaluate("dashboard.state.running.length")
        # (On a loaded machine the browser may get here after the two requests have finished: the
        # drawn map must equal the snapshot's blocks either way.)
        assert running <= 2 and drawn == stats["num_kv_blocks"] - stats["num_free_blocks"]
        assert min(before, after) - running <= drawn <= max(before, after) + running, (before, drawn, after)
        page.click("#pause")
        for t in threads:
            t.join(120)

        # A tiny pool: four requests that outgrow it, so the newest is preempted.
        threads = [_complete(srv, _tokens(3000 + 100 * i, 80 + i), 40 + i, results) for i in range(4)]
        _wait(page, HAS_PREEMPTED_CELL, 90)
        _save(page, tmp_path, "dashboard.png")
        for t in threads:
            t.join(180)
        assert all("choices" in r for r in results.values()), results

        # The request of 83 prompt tokens: in the timeline, then in the table with its finish reason.
        row = _wait(
            page,
            "dashboard.table.find(r => r.prompt_tokens === 83 && r.finish_reason === 'length' "
            "&& r.output_tokens === 43) || null",
        )
        steps = page.evaluate("[...dashboard.steps.values()].map(s => s.scheduled.map(x => x[0]))")
        assert any(row["request_id"] in ids for ids in steps)
        assert row["request_id"] in page.evaluate("dashboard.timeline.rows")
        page.click(f"#request-table tr[data-id='{row['request_id']}']")
        assert "holds no blocks" in page.inner_text("#detail")
        assert page.locator("#request-table tbody tr").count() >= 6

        srv.wait_idle(timeout=20)
        state = srv.get("/v1/engine/state?steps=0").json()
        assert len(state["blocks"]) == NUM_BLOCKS and all(b <= 0 for b in state["blocks"])
        assert state["stats"]["num_preemptions"] >= 1
        assert errors == [], errors
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000


@pytest.mark.slow
def test_state_and_events_over_engine_core_processes() -> None:
    """The default server (the engine in a core process): the snapshot comes from the core's step loop
    and the step records travel with its outputs, to the state and to the event stream."""
    args = ["--max-model-len", "512", "--num-kv-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK)]
    with RemoteServer(args, api_key=KEY) as srv:
        results: dict[int, Any] = {}
        _complete(srv, _tokens(500, 37), 9, results).join(120)
        assert results[37]["usage"]["completion_tokens"] == 9
        state = srv.get("/v1/engine/state").json()
        assert state["ranks"] == [0] and len(state["blocks"]) == NUM_BLOCKS
        assert state["config"]["num_kv_blocks"] == NUM_BLOCKS
        finished = [f for f in state["finished"] if f["prompt_tokens"] == 37]
        assert len(finished) == 1 and finished[0]["finish_reason"] == "length"
        rid = finished[0]["request_id"]
        kinds = [k for s in state["steps"] for r, _, k in s["scheduled"] if r == rid]
        assert kinds == ["prefill"] + ["decode"] * 8
        assert srv.get("/v1/engine/state?rank=3").status_code == 400
        # The event stream: the steps after the ones above, as a second request runs.
        last = state["steps"][-1]["step"]
        _complete(srv, _tokens(900, 21), 4, results).join(120)
        seen: list[dict[str, Any]] = []
        with httpx.stream(
            "GET", srv.url(f"/v1/engine/events?since={last}"), headers=srv.headers(), timeout=30
        ) as events:
            assert events.headers["content-type"].startswith("text/event-stream")
            for line in events.iter_lines():
                if line.startswith("data: "):
                    seen += json.loads(line[6:])
                if sum(s["output_tokens"] for s in seen) >= 4:
                    break
        assert seen[0]["step"] == last + 1 and seen[0]["scheduled"][0][1:] == [21, "prefill"]
        srv.wait_idle()
        assert all(b <= 0 for b in srv.get("/v1/engine/state").json()["blocks"])
        for path in DASHBOARD_ROUTES:
            assert httpx.get(srv.url(path), timeout=10).status_code == 401
