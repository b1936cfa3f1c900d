"""Errors as OpenAI error bodies: `ApiError`, the ASCII-only JSON response, and the exception handlers
`build_app` installs (a body that fails validation, an `ApiError`, any other HTTP error).

Every error answers ``{"error": {"message", "type", "param", "code"}}`` (`error_body`) with its status.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvdiet.server.protocol import error_body

__all__ = ["EXCEPTION_HANDLERS", "ApiError", "AsciiJSONResponse"]


class AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped (``\\uXXXX``): a request's unpaired surrogate echoed in an
    error message stays valid JSON instead of failing to encode as UTF-8 (a 500)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


class ApiError(Exception):
    """An error answered with an OpenAI error body (400 unless ``status`` says otherwise).

    Args:
        message: the body's ``message``.
        param: the request field at fault (the body's ``param``), or None.
        status: the HTTP status (also the body's ``code``).
        kind: the body's ``type``.
    """

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


async def _invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
    """400: malformed JSON, or every schema error as ``field: message`` joined by ``; `` — except a prompt
    token id that is not an integer (``token_id``), whose message is `LLM.generate`'s word for word, as an
    id outside the vocabulary is (``param`` names the field)."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return AsciiJSONResponse(error_body(f"malformed JSON body: {first.get('msg')}", status=400), 400)
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    message = "; ".join(
        e.get("msg")
        if e.get("type") == "token_id"
        else f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
        for e in errors
    )
    return AsciiJSONResponse(error_body(message, status=400, param=".".join(loc) or None), 400)


async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return AsciiJSONResponse(
        error_body(str(exc), status=exc.status, kind=exc.kind, param=exc.param), exc.status
    )


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (404, 405, ...) in the OpenAI shape."""
    return AsciiJSONResponse(error_body(str(exc.detail), status=exc.status_code), exc.status_code)


EXCEPTION_HANDLERS = {
    RequestValidationError: _invalid_body,
    ApiError: _api_error,
    StarletteHTTPException: _http_error,
}
"""Exception class → handler, for ``FastAPI(exception_handlers=...)``."""
