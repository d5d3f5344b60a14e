"""Probes the sections put into a running engine: a method wrapped for a while, and the
synchronising CUDA calls made inside a block."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def patched(
    obj: Any, name: str, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Iterator[None]:
    """Temporarily set the instance attribute ``obj.name`` to ``wrapper(obj.name)``."""
    own = vars(obj)
    had_own = name in own
    previous = own.get(name)
    setattr(obj, name, wrapper(getattr(obj, name)))
    try:
        yield
    finally:
        if had_own:
            setattr(obj, name, previous)
        else:
            delattr(obj, name)


# Torch warns once, when the mode is first set, that it is a prototype; that is no synchronising call.
_SYNC_DEBUG_NOTICE = "Synchronization debug mode is a prototype"


@contextmanager
def sync_warnings(messages: list[str]) -> Iterator[None]:
    """Append to ``messages`` the first line of every synchronising CUDA call made inside (as
    ``torch.cuda.set_sync_debug_mode`` reports them)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
            texts = [str(w.message) for w in caught]
            messages.extend(t.splitlines()[0] for t in texts if not t.startswith(_SYNC_DEBUG_NOTICE))
