"""Small helpers shared by every layer (they import nothing from pagedllm)."""

from __future__ import annotations

import json
import os
import random
import socket
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    """The root of pagedllm's on-disk cache."""
    explicit = os.environ.get("PAGEDLLM_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pagedllm"


def read_json(path: str) -> Any:
    """The JSON value in the file at ``path``; ValueError naming the file when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"Could not read {path}: {exc}") from exc


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel hands out for outgoing connections and ``bind(port 0)`` (Linux's
    ``ip_local_port_range``; the IANA range elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


PORT_RANGE_ENV = "PAGEDLLM_PORT_RANGE"


def port_spans(count: int = 1) -> list[tuple[int, int]]:
    """The spans of ports (inclusive) that :func:`free_port_range` chooses from, each holding
    ``count`` consecutive ports: ``$PAGEDLLM_PORT_RANGE`` (``LOW-HIGH``) when set, else every port
    from 10000 up outside the kernel's ephemeral range. ValueError naming the variable when it is
    malformed or too narrow."""
    configured = os.environ.get(PORT_RANGE_ENV, "").strip()
    if configured:
        try:
            low_text, high_text = configured.split("-")
            low, high = int(low_text), int(high_text)
        except ValueError:
            raise ValueError(
                f"{PORT_RANGE_ENV} must be LOW-HIGH (two port numbers), got {configured!r}"
            ) from None
        if not 1024 <= low <= high <= 65535:
            raise ValueError(
                f"{PORT_RANGE_ENV} must satisfy 1024 <= LOW <= HIGH <= 65535, got {configured!r}"
            )
        if high - low + 1 < count:
            raise ValueError(
                f"{PORT_RANGE_ENV}={configured} holds fewer than the {count} consecutive ports needed"
            )
        return [(low, high)]
    low, high = ephemeral_port_range()
    spans = [(lo, hi) for lo, hi in ((10000, low - 1), (high + 1, 65535)) if hi - lo + 1 >= count]
    if not spans:
        raise RuntimeError(f"no ports outside the ephemeral range {low}-{high} to choose from")
    return spans


def free_port_range(host: str = "127.0.0.1", count: int = 1, attempts: int = 100) -> int:
    """A port ``p`` such that ``p .. p + count - 1`` are free on ``host`` right now.

    The ports come from :func:`port_spans`: by default from outside the kernel's ephemeral range. A
    port chosen now is bound later by another process, and in between a port of the ephemeral range
    can be taken by any outgoing connection; worse, a client that connects (and retries, as ZeroMQ
    does) to a local port of that range before anything listens can be given that same port as its
    own source port and so connect to itself, which takes the port for good. Programs that start
    servers side by side (test runners on several workers) give each its own ``$PAGEDLLM_PORT_RANGE``
    so that one cannot take a port another has chosen but not yet bound."""
    spans = port_spans(count)
    for _ in range(attempts):
        lo, hi = random.choice(spans)
        base = random.randint(lo, hi - count + 1)
        socks: list[socket.socket] = []
        try:
            for i in range(count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((host, base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"found no {count} consecutive free ports on {host}")


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the process that started it exits (no orphans of
    engine cores, server processes or model ranks)."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux
        pass
