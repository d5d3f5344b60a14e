"""Small helpers shared by every layer (they import nothing from pagedllm)."""

from __future__ import annotations

import json
import os
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
