"""Headless Chromium for the browser tests: Debian's ``chromium`` package (installed with apt-get when
absent and the tests run as root, as in CI) driven by Playwright with the system browser; Playwright's
own browser downloads are never used."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
INSTALL_TIMEOUT_S = 900


def chromium_path() -> str:
    """The system Chromium, installed on the way when missing and possible; skips the test with the
    reason otherwise."""
    path = shutil.which("chromium")
    if path is not None:
        return path
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("chromium is not installed (apt-get install chromium, as root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        if done.returncode != 0:
            pytest.skip(f"could not install chromium ({' '.join(cmd)}): {done.stderr[-500:]}")
    path = shutil.which("chromium")
    if path is None:
        pytest.skip("chromium is still missing after apt-get install chromium")
    return path


@contextmanager
def browser_page(viewport: tuple[int, int] = (1440, 1000)) -> Iterator[tuple[Any, list[str]]]:
    """A new page of a headless Chromium, and the list that collects its console errors and
    uncaught exceptions (as they happen)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    executable = chromium_path()
    errors: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS, timeout=60_000)
        try:
            page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
            page.set_default_timeout(30_000)
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(f"uncaught: {exc}"))
            yield page, errors
        finally:
            browser.close()
