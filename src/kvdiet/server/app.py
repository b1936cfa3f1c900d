"""The OpenAI-compatible API over an `EngineLoop` (FastAPI): `build_app` wires the routes, the error
handlers, the API key and the loop's lifetime.

Routes (`kvdiet.server.routes`): ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream: true`` → server-sent events ending in ``data: [DONE]``, `kvdiet.server.streaming`),
``GET /v1/models``, ``GET /health``, ``GET /metrics``.

Every request is validated once, at the edge, before it reaches the engine; failures are HTTP 400 with an
OpenAI error body (`kvdiet.server.errors`) and the engine keeps serving. With an API key (a non-empty one:
an empty key, as vLLM reads it, means none), ``/v1/*`` answers 401 without ``Authorization: Bearer <key>``.
A client that disconnects (streaming or not) aborts its request: its blocks return to the pool at the next
step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI

from kvdiet.engine.loop import EngineLoop
from kvdiet.server.errors import EXCEPTION_HANDLERS, AsciiJSONResponse
from kvdiet.server.metrics import ServerMetrics
from kvdiet.server.protocol import error_body
from kvdiet.server.routes import ServerContext, router

__all__ = ["MAX_BODY_BYTES", "build_app"]


class _ApiKeyMiddleware:
    """Answers 401 on ``/v1/*`` without ``Authorization: Bearer <key>`` (plain ASGI, so streaming responses
    and disconnect detection pass through untouched). The scheme is case-insensitive and one or more spaces
    may follow it (RFC 9110 §11.1, §11.4); the key is compared in constant time."""

    def __init__(self, app: Callable, *, api_key: str) -> None:
        self.app, self.expected = app, api_key.encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            bearer = scheme.lower() == b"bearer"
            if not (secrets.compare_digest(token.lstrip(b" "), self.expected) and bearer):
                body = error_body("invalid or missing API key", status=401, kind="authentication_error")
                await AsciiJSONResponse(body, 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


MAX_BODY_BYTES = 32 << 20
"""The largest request body served (bytes): a 1M-token prompt as JSON token ids takes some 8 MB. A body that
declares more (``Content-Length``) is a 413 before it is read (a 50 MB one was read and tokenized, then refused);
one sent in chunks (no ``Content-Length``) is read up to the cap, then a 413 (a 64 MB one took 10 GB)."""


class _BodyCapMiddleware:
    """Answers 413 to a request whose body exceeds `MAX_BODY_BYTES` (plain ASGI, as `_ApiKeyMiddleware`): by its
    ``Content-Length`` before any of it is read; without one (``Transfer-Encoding: chunked``) it is read here,
    at most the cap, and handed on whole."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > MAX_BODY_BYTES:
                message = f"the body is {int(length):,} bytes, over the {MAX_BODY_BYTES:,} this server reads"
                await AsciiJSONResponse(error_body(message, status=413), 413)(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: the app sees it as it would have
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > MAX_BODY_BYTES:
                text = f"the body (sent in chunks) is over the {MAX_BODY_BYTES:,} bytes this server reads"
                await AsciiJSONResponse(error_body(text, status=413), 413)(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)


def _replay(messages: list[dict], receive: Callable) -> Callable:
    """A ``receive`` that returns ``messages`` first, then what ``receive`` returns (a disconnect)."""
    pending = list(messages)

    async def replayed() -> dict:
        return pending.pop(0) if pending else await receive()

    return replayed


def build_app(
    loop: EngineLoop,
    *,
    model_name: str,
    metrics: ServerMetrics,
    api_key: str | None = None,
    default_max_tokens: int = 256,
) -> FastAPI:
    """The FastAPI application. Its lifespan starts ``loop`` and closes it (aborting what runs) at shutdown.

    Args:
        loop: the engine loop (not started yet, or started: `start` is idempotent).
        model_name: the name clients must use in ``model`` (``GET /v1/models`` lists it).
        metrics: the registry behind ``/metrics`` (its observer should be the engine's).
        api_key: when non-empty, required as a bearer token on ``/v1/*``; None or ``""``: no authentication.
        default_max_tokens: chat ``max_tokens`` when the request gives none (capped by the context left).
    """

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(loop.close)

    app = FastAPI(
        title="kvdiet",
        summary="OpenAI-compatible server of the kvdiet engine",
        lifespan=lifespan,
        default_response_class=AsciiJSONResponse,
        exception_handlers=EXCEPTION_HANDLERS,
    )
    app.state.server = ServerContext(loop, model_name, metrics, default_max_tokens)
    # the last added is the outer one: the key is checked first (no body of a caller without one is read), then
    # the body's size
    app.add_middleware(_BodyCapMiddleware)
    if api_key:  # "" (``KVDIET_API_KEY=`` or ``--api-key ''``) is no key, as vLLM reads it
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)
    app.include_router(router)
    return app
