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

from kvdiet.engine.chat_messages import json_type
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


async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    """400: a body that is not a JSON object (`_body_fault`), or every schema error as ``field: message`` joined
    by ``; `` — except a prompt token id that is not an integer (``token_id``), whose message is `LLM.generate`'s
    word for word, as an id outside the vocabulary is (``param`` names the field)."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    fault = _body_fault(request, first, exc.body)
    if fault is not None:
        return AsciiJSONResponse(error_body(fault, status=400), 400)
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    message = "; ".join(
        e.get("msg")
        if e.get("type") == "token_id"
        else f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
        for e in errors
    )
    return AsciiJSONResponse(error_body(message, status=400, param=".".join(loc) or None), 400)


def _body_fault(request: Request, first: dict, doc: Any) -> str | None:
    """Why the body as a whole cannot be read, in one line, from FastAPI's first error ``first`` (``doc``: the
    text FastAPI parsed): malformed JSON (its position as line, column and character offset), a body FastAPI did
    not parse as JSON for its ``Content-Type`` (it then hands the raw bytes on: ``text/plain``, curl's default
    ``application/x-www-form-urlencoded``, none), an empty body, or JSON that is not an object. None when the
    error is a field's."""
    kind = first.get("type")
    if kind == "json_invalid":
        pos = first.get("loc", (None, None))[-1]
        where = ""
        if isinstance(doc, str) and isinstance(pos, int):
            line, column = doc.count("\n", 0, pos) + 1, pos - doc.rfind("\n", 0, pos)  # as json's own message
            where = f" at line {line} column {column} (char {pos})"
        return f"malformed JSON body: {first.get('ctx', {}).get('error') or first.get('msg')}{where}"
    if tuple(first.get("loc", ())) != ("body",):
        return None
    if kind == "missing":
        return "empty body: send a JSON object with Content-Type: application/json"
    if kind in ("model_attributes_type", "model_type", "dict_type"):
        value = first.get("input")
        if isinstance(value, bytes | bytearray):  # FastAPI parses JSON only for application/json or */*+json
            ctype = request.headers.get("content-type")
            got = f"Content-Type: {ctype}" if ctype else "no Content-Type"
            return f"the body must be JSON sent with Content-Type: application/json (got {got})"
        return f"the body must be a JSON object (got {json_type(value)})"
    return None


async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return AsciiJSONResponse(
        error_body(str(exc), status=exc.status, kind=exc.kind, param=exc.param), exc.status
    )


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (404, 405, ...) in the OpenAI shape, with their headers (a 405's ``Allow``); a JSON
    body that is not UTF-8 (FastAPI's generic "error parsing the body", raised from the decoding error) names the
    first byte at fault."""
    cause = exc.__cause__
    if exc.status_code == 400 and isinstance(cause, UnicodeDecodeError):
        bad = cause.object[cause.start : cause.end].hex(" ")
        message = f"the body is not UTF-8: byte(s) {bad} at offset {cause.start} (JSON bodies must be UTF-8)"
        return AsciiJSONResponse(error_body(message, status=400), 400)
    return AsciiJSONResponse(
        error_body(str(exc.detail), status=exc.status_code), exc.status_code, headers=exc.headers
    )


EXCEPTION_HANDLERS = {
    RequestValidationError: _invalid_body,
    ApiError: _api_error,
    StarletteHTTPException: _http_error,
}
"""Exception class → handler, for ``FastAPI(exception_handlers=...)``."""
