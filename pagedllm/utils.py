"""Small helpers shared by every layer (they import nothing from pagedllm)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The root of pagedllm's on-disk cache."""
    explicit = os.environ.get("PAGEDLLM_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pagedllm"
