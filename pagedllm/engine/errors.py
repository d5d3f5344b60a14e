"""Errors a request can end with, besides a ValueError for invalid input."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine (its thread, or every core process that could serve the request) has stopped."""


class QueueFullError(RuntimeError):
    """The waiting queue would hold more than ``max_queued_requests`` sequences."""


class RequestAbortedError(RuntimeError):
    """The request was aborted by the server (for example at the end of a shutdown grace period)."""


__all__ = ["EngineDeadError", "QueueFullError", "RequestAbortedError"]
