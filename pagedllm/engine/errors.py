"""Errors a request can end with: a :class:`~pagedllm.errors.RequestError` when it is refused (a
:class:`~pagedllm.errors.QueueFullError` when the waiting queue is full), or one of these."""

from __future__ import annotations

from pagedllm.errors import QueueFullError, RequestError, request_error


def queue_full_error(waiting: int, adds: int, limit: int) -> QueueFullError:
    """The refusal of a request of ``adds`` sequences while ``waiting`` wait, under ``limit``."""
    return QueueFullError(
        f"The server is overloaded: {waiting} sequences are already waiting and this request adds {adds} "
        f"(max_queued_requests={limit}). Retry later."
    )


def grammar_timeout_error(timeout: float) -> RequestError:
    """The refusal of a request whose grammar took longer than ``timeout`` seconds to compile."""
    return RequestError(
        "structured_outputs", f"structured_outputs: compiling the grammar took longer than {timeout:g} s."
    )


def as_request_error(exc: BaseException) -> RequestError:
    """``exc`` as the refusal of a request: itself if it is one, else a refusal naming no field with
    its text (what a core process reports for a request the engine could not take)."""
    return exc if isinstance(exc, RequestError) else RequestError(None, str(exc))


class EngineDeadError(RuntimeError):
    """The engine (its thread, or every core process that could serve the request) has stopped."""


class RequestAbortedError(RuntimeError):
    """The request was aborted by the server (for example at the end of a shutdown grace period)."""


__all__ = [
    "EngineDeadError",
    "QueueFullError",
    "RequestAbortedError",
    "RequestError",
    "as_request_error",
    "grammar_timeout_error",
    "queue_full_error",
    "request_error",
]
