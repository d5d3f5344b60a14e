"""The error of a refused request, shared by every layer that checks a request.

A request the engine refuses raises :class:`RequestError`: the request field it names (``param``),
a machine-readable ``code`` and the message. It is a ``ValueError`` (offline callers catch it as one)
and crosses the core-process protocol as those three fields, so a front-end raises the same error a
core raised. The HTTP status and OpenAI error type follow from the code (:data:`ERROR_CODES`); the
HTTP layer turns a :class:`RequestError` into OpenAI's error object in one place.
"""

from __future__ import annotations

# code -> (HTTP status, OpenAI error type). None: an invalid request.
ERROR_CODES: dict[str | None, tuple[int, str]] = {
    None: (400, "invalid_request_error"),
    "context_length_exceeded": (400, "invalid_request_error"),
    "model_not_found": (404, "invalid_request_error"),
    "queue_full": (503, "server_error"),
}


class RequestError(ValueError):
    """A refused request: ``param`` is the request field at fault (None: none in particular),
    ``code`` one of :data:`ERROR_CODES` (None: an invalid request, 400)."""

    def __init__(self, param: str | None, message: str, code: str | None = None) -> None:
        if code not in ERROR_CODES:
            raise ValueError(f"unknown request error code {code!r}")
        super().__init__(message)
        self.param = param
        self.message = message
        self.code = code

    @property
    def status_code(self) -> int:
        return ERROR_CODES[self.code][0]

    @property
    def type(self) -> str:
        return ERROR_CODES[self.code][1]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(param={self.param!r}, code={self.code!r}, message={self.message!r})"

    def __reduce__(self) -> tuple[object, ...]:
        return (request_error, (self.param, self.message, self.code))


class QueueFullError(RequestError):
    """The waiting queue would hold more than ``max_queued_requests`` sequences (503 ``queue_full``)."""

    def __init__(self, message: str) -> None:
        super().__init__(None, message, "queue_full")


def request_error(param: str | None, message: str, code: str | None = None) -> RequestError:
    """The error of a refusal with these fields (a :class:`QueueFullError` for ``queue_full``)."""
    if code == "queue_full":
        return QueueFullError(message)
    return RequestError(param, message, code)


def context_length_error(param: str, message: str) -> RequestError:
    """A prompt (with its ``max_tokens``) longer than the model's context."""
    return RequestError(param, message, "context_length_exceeded")


__all__ = ["ERROR_CODES", "QueueFullError", "RequestError", "context_length_error", "request_error"]
