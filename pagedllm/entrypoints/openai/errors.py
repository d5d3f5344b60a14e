"""The error every endpoint answers with: OpenAI's ``{"error": {...}}`` object and an HTTP status."""

from __future__ import annotations

from collections.abc import Mapping

from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse


class OpenAIError(Exception):
    """An error answered with OpenAI's error object and an HTTP status."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def to_body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        )

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.to_body().model_dump(), status_code=self.status_code, headers=self.headers)
