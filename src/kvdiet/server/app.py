"""The OpenAI-compatible API over an `EngineLoop` (FastAPI).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true`` → server-sent
events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``.

Every request is validated before it reaches the engine (body schema, model name, unsupported fields,
token ids, context length); failures are HTTP 400 with an OpenAI error body and the engine keeps serving.
With an API key, ``/v1/*`` answers 401 without ``Authorization: Bearer <key>``. A client that disconnects
(streaming or not) aborts its request: its blocks return to the pool at the next step boundary.

``usage`` carries ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` and
``prompt_tokens_details``: ``cached_tokens`` (OpenAI's field: prompt tokens whose KV came from a cache
tier) split into ``device_tokens`` and ``persistent_tokens``, plus ``window_source`` and
``replayed_tokens`` (how the window state at the hit was rebuilt).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvdiet.engine.loop import EngineDeadError, EngineLoop
from kvdiet.engine.request import RequestOutput
from kvdiet.engine.sampling import SamplingParams
from kvdiet.server.chat_template import render_chat
from kvdiet.server.metrics import CONTENT_TYPE, ServerMetrics
from kvdiet.server.protocol import ChatCompletionRequest, CompletionRequest, _Common, error_body

__all__ = ["build_app"]

_DISCONNECT_POLL_S = 0.5


class _JSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped (``\\uXXXX``): a request's unpaired surrogate echoed in an
    error message stays valid JSON instead of failing to encode as UTF-8 (a 500)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


class _ApiError(Exception):
    """An error answered with an OpenAI error body (400 unless ``status`` says otherwise)."""

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


class _ApiKeyMiddleware:
    """Answers 401 on ``/v1/*`` without ``Authorization: Bearer <key>`` (plain ASGI, so streaming responses
    and disconnect detection pass through untouched)."""

    def __init__(self, app: Callable, *, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                body = error_body("invalid or missing API key", status=401, kind="authentication_error")
                await _JSONResponse(body, 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
        api_key: when set, required as a bearer token on ``/v1/*``.
        default_max_tokens: chat ``max_tokens`` when the request gives none (capped by the context left).
    """
    engine = loop.engine

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
        default_response_class=_JSONResponse,
    )

    if api_key is not None:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return _JSONResponse(error_body(f"malformed JSON body: {first.get('msg')}", status=400), 400)
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
            for e in errors
        )
        return _JSONResponse(error_body(message, status=400, param=".".join(loc) or None), 400)

    @app.exception_handler(_ApiError)
    async def api_error(_: Request, exc: _ApiError) -> JSONResponse:
        return _JSONResponse(
            error_body(str(exc), status=exc.status, kind=exc.kind, param=exc.param), exc.status
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _JSONResponse(error_body(str(exc.detail), status=exc.status_code), exc.status_code)

    def check_common(body: _Common) -> None:
        if body.model is not None and body.model != model_name:
            raise _ApiError(
                f"the model {body.model!r} does not exist; this server serves {model_name!r}", param="model"
            )
        problem = body.unsupported()
        if problem is not None:
            raise _ApiError(problem)
        if body.stream_options is not None and not body.stream:
            raise _ApiError("stream_options is only allowed with stream: true", param="stream_options")
        if not loop.healthy:
            raise _ApiError("the engine is not running", status=503, kind="service_unavailable")

    def prepare(prompt: str | list[int], params: SamplingParams) -> list[int]:
        try:
            params.check_vocab(engine.model.cfg.vocab_size)
        except ValueError as exc:
            raise _ApiError(
                str(exc), param="stop_token_ids" if "stop" in str(exc) else "logit_bias"
            ) from None
        try:
            return engine.prepare(prompt, params)
        except ValueError as exc:
            raise _ApiError(str(exc), param="prompt") from None

    def sampling(body: _Common, max_tokens: int) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens)
        except ValueError as exc:
            raise _ApiError(str(exc)) from None

    @app.get("/health")
    async def health() -> Response:
        if loop.healthy:
            return Response(status_code=200)
        return _JSONResponse(
            error_body("the engine is not running", status=503, kind="service_unavailable"), 503
        )

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "kvdiet",
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_common(body)
        try:
            prompt = body.single_prompt()
        except ValueError as exc:
            raise _ApiError(str(exc), param="prompt") from None
        params = sampling(body, body.max_tokens if body.max_tokens is not None else 16)
        ids = prepare(prompt, params)
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        def chunk(out: RequestOutput, *, final: bool = False) -> dict:
            choice = {
                "index": 0,
                "text": out.text if final else out.new_text,
                "logprobs": None,
                "finish_reason": _finish_reason(out),
            }
            if body.return_token_ids:
                choice["token_ids"] = list(out.output_ids if final else out.new_token_ids)
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model_name,
                "choices": [choice],
            } | ({"prompt_token_ids": ids} if body.return_token_ids and final else {})

        if body.stream:
            return _sse(
                loop, ids, params, rid, chunk, _include_usage(body), created, model_name, "text_completion"
            )
        out = await _final(loop, ids, params, rid, request)
        if out is None:
            return Response(status_code=499)  # the client closed the connection (nginx's code)
        return _JSONResponse(chunk(out, final=True) | {"usage": _usage(out)})

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        check_common(body)
        if engine.tokenizer is None:
            raise _ApiError(
                "this model has no tokenizer, so no chat template: use /v1/completions with token ids"
            )
        kwargs = dict(body.chat_template_kwargs or {})
        thinking = kwargs.pop("thinking", False)
        if not isinstance(thinking, bool) or kwargs:
            raise _ApiError(
                "chat_template_kwargs takes only 'thinking' (true or false)", param="chat_template_kwargs"
            )
        try:
            text = render_chat([m.model_dump() for m in body.messages], thinking=thinking)
        except ValueError as exc:
            raise _ApiError(str(exc), param="messages") from None
        try:
            prompt_ids = engine.tokenizer.encode(text)
        except ValueError as exc:
            raise _ApiError(str(exc), param="messages") from None
        wanted = body.max_completion_tokens or body.max_tokens
        if wanted is None and len(prompt_ids) >= engine.max_model_len:
            raise _ApiError(
                f"the prompt ({len(prompt_ids)} tokens) leaves no room for output: max_model_len is "
                f"{engine.max_model_len}",
                param="messages",
            )
        max_tokens = (
            wanted
            if wanted is not None
            else max(1, min(default_max_tokens, engine.max_model_len - len(prompt_ids)))
        )
        params = sampling(body, max_tokens)
        ids = prepare(prompt_ids, params)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        first = [True]

        def chunk(out: RequestOutput) -> dict:
            delta: dict[str, Any] = {"content": out.new_text}
            if first[0]:  # the first chunk also names the role
                delta, first[0] = {"role": "assistant"} | delta, False
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": _finish_reason(out)}
            if body.return_token_ids:
                choice["token_ids"] = list(out.new_token_ids)
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model_name,
                "choices": [choice],
            }

        if body.stream:
            return _sse(
                loop,
                ids,
                params,
                rid,
                chunk,
                _include_usage(body),
                created,
                model_name,
                "chat.completion.chunk",
            )
        out = await _final(loop, ids, params, rid, request)
        if out is None:
            return Response(status_code=499)
        return _JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": out.text},
                        "logprobs": None,
                        "finish_reason": _finish_reason(out),
                    }
                    | ({"token_ids": list(out.output_ids)} if body.return_token_ids else {})
                ],
                "usage": _usage(out),
            }
            | ({"prompt_token_ids": ids} if body.return_token_ids else {})
        )

    return app


def _finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finished else None


def _include_usage(body: _Common) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _usage(out: RequestOutput) -> dict:
    p = out.provenance
    details: dict[str, Any] = {"cached_tokens": out.cached_tokens}
    if p is not None:
        details |= {
            "device_tokens": p.device_tokens,
            "persistent_tokens": p.persistent_tokens,
            "window_source": p.window_source,
            "replayed_tokens": p.replayed_tokens,
        }
    return {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": len(out.output_ids),
        "total_tokens": out.prompt_tokens + len(out.output_ids),
        "prompt_tokens_details": details,
    }


async def _final(
    loop: EngineLoop, ids: list[int], params: SamplingParams, rid: str, request: Request
) -> RequestOutput | None:
    """Run a request to its end; a client that disconnects first aborts it (then None: nobody to answer)."""

    async def consume() -> RequestOutput:
        last = None
        async with contextlib.aclosing(loop.generate(ids, params, request_id=rid)) as outputs:
            async for out in outputs:
                last = out
        return last

    task = asyncio.ensure_future(consume())
    try:
        while not task.done():
            await asyncio.wait([task], timeout=_DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()  # leaving `generate` early aborts the request
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return None
        return task.result()
    except EngineDeadError as exc:
        raise _ApiError(str(exc), status=503, kind="service_unavailable") from None
    except ValueError as exc:
        raise _ApiError(str(exc)) from None
    finally:
        if not task.done():
            task.cancel()


def _sse(
    loop: EngineLoop,
    ids: list[int],
    params: SamplingParams,
    rid: str,
    chunk: Callable[[RequestOutput], dict],
    include_usage: bool,
    created: int,
    model_name: str,
    kind: str,
) -> StreamingResponse:
    """Server-sent events: one chunk per output, the usage chunk if asked, then ``[DONE]``. A disconnect
    cancels this generator, which aborts the request."""

    async def events() -> AsyncIterator[str]:
        last = None
        try:
            async with contextlib.aclosing(loop.generate(ids, params, request_id=rid)) as outputs:
                async for out in outputs:
                    last = out
                    yield f"data: {json.dumps(chunk(out))}\n\n"
        except EngineDeadError as exc:
            yield f"data: {json.dumps(error_body(str(exc), status=503, kind='service_unavailable'))}\n\n"
        except ValueError as exc:  # the engine refused the request
            yield f"data: {json.dumps(error_body(str(exc), status=400))}\n\n"
        else:
            if include_usage and last is not None:
                usage = {"id": rid, "object": kind, "created": created, "model": model_name, "choices": []}
                yield f"data: {json.dumps(usage | {'usage': _usage(last)})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
