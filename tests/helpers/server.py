"""Start a real ``python -m pagedllm serve`` subprocess for end-to-end tests of the HTTP server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.utils import free_port_range

REPO_ROOT = Path(__file__).resolve().parents[2]

# A small engine: short context and KV cache keep start-up and memory low on CPU.
SMALL_ENGINE_ARGS = ["--max-model-len", "1024", "--num-kv-blocks", "256"]
# The shipped Hermes-style tool template for SmolLM2 (its own template has no tool section).
TOOL_TEMPLATE = REPO_ROOT / "pagedllm" / "model" / "chat_templates" / "smollm2_hermes_tools.jinja"
# A server that calls tools: the parser for tool_choice "auto" and nothing else (the default model's
# requests with tools are rendered with the shipped template).
TOOL_SERVER_ARGS = [*SMALL_ENGINE_ARGS, "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]


def assert_serve_flags(flags: list[str], problem: str | None) -> None:
    """``pagedllm serve``'s argument check passes ``flags`` (``problem`` None) or refuses them with a
    message starting with ``problem``."""
    import argparse

    from pagedllm.entrypoints.openai.cli_args import add_cli_args, check_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    found = check_args(parser.parse_args(flags))
    if problem is None:
        assert found is None, found
    else:
        assert found is not None and found.startswith(problem), found


def free_port() -> int:
    """A free local port outside the ephemeral range (see ``free_port_range``)."""
    return free_port_range("127.0.0.1", 1)


class RemoteServer:
    """A ``pagedllm serve`` process on a free local port; use as a context manager.

    Its output goes to a temporary log file (``log_tail()`` shows the end of it), so a chatty server
    can never block on a full pipe.
    """

    def __init__(
        self,
        args: list[str] | None = None,
        *,
        api_key: str | None = None,
        env: dict[str, str] | None = None,
        startup_timeout: float = 240.0,
    ) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.args = list(args if args is not None else SMALL_ENGINE_ARGS)
        if api_key is not None:
            self.args += ["--api-key", api_key]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), self.env.get("PYTHONPATH")]))
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="pagedllm-serve-", suffix=".log", delete=False)

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> RemoteServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "pagedllm",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.args,
        ]
        self.proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=self.env, stdout=self._log, stderr=subprocess.STDOUT
        )
        self.wait_ready()

    def wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with status {self.proc.returncode} during start-up:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.url("/health"), timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not ready after {self.startup_timeout:.0f}s:\n{self.log_tail()}")

    def terminate(self) -> None:
        """Send SIGTERM (a graceful shutdown)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()

    @property
    def pid(self) -> int:
        """The server process's id (for psutil: its memory, its children)."""
        assert self.proc is not None, "the server was not started"
        return self.proc.pid

    def log_tail(self, lines: int = 60) -> str:
        self._log.flush()
        text = Path(self._log.name).read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    # ------------------------------------------------------------------ clients

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 120.0)
        return openai.OpenAI(base_url=self.url("/v1"), api_key=self.api_key or "EMPTY", **kwargs)

    def async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 120.0)
        return openai.AsyncOpenAI(base_url=self.url("/v1"), api_key=self.api_key or "EMPTY", **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        kwargs.setdefault("timeout", 120.0)
        headers = {**self.headers(), **kwargs.pop("headers", {})}
        return httpx.post(self.url(path), headers=headers, **kwargs)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        kwargs.setdefault("timeout", 30.0)
        headers = {**self.headers(), **kwargs.pop("headers", {})}
        return httpx.get(self.url(path), headers=headers, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Samples of ``/metrics`` by sample name, summed over label values."""
        return parse_metrics(self.get("/metrics").text)

    def wait_for_metrics(self, condition: Any, timeout: float = 10.0) -> dict[str, float]:
        """Poll ``/metrics`` until ``condition(samples)`` holds; returns the last samples."""
        deadline = time.monotonic() + timeout
        samples = self.metrics()
        while not condition(samples) and time.monotonic() < deadline:
            time.sleep(0.2)
            samples = self.metrics()
        return samples

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Wait until no request runs or waits and every KV block is free (assert it); returns the
        last ``/metrics`` samples."""
        samples = self.wait_for_metrics(is_idle, timeout)
        assert is_idle(samples), {k: v for k, v in samples.items() if k in IDLE_GAUGES}
        return samples


# Gauges that read 0 when the engine is idle with every KV block free.
IDLE_GAUGES = (
    "pagedllm:num_requests_running",
    "pagedllm:num_requests_waiting",
    "pagedllm:kv_cache_usage_perc",
)


def is_idle(samples: dict[str, float]) -> bool:
    return all(samples.get(name) == 0 for name in IDLE_GAUGES)


def parse_metrics(text: str) -> dict[str, float]:
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + float(sample.value)
    return samples
