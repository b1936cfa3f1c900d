"""The API's route handlers, module-level on one `APIRouter`; `build_app` includes it.

Each handler reads the server's `ServerContext` (engine loop, served model name, metrics, chat default) from
``request.app.state`` through a FastAPI dependency. A generation request is validated once, here at the
edge, before it reaches the engine (body schema, model name, unsupported fields, then `LLMEngine.prepare`:
token ids, stop and logit-bias ids, context length); failures are HTTP 400 with an OpenAI error body and
the engine keeps serving. The prepared request goes down unchanged (`kvdiet.engine.prepared`).

Tokenizing (a prompt, a chat's messages) runs in a worker thread, never on the event loop: a prompt of some
megabytes takes seconds to tokenize, and ``/health`` and the streams of other requests answer meanwhile.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from kvdiet.engine.chat_template import chat_prompt_ids, chat_thinking
from kvdiet.engine.loop import EngineLoop
from kvdiet.engine.prepared import ContextLengthError, InvalidRequestError, PreparedRequest
from kvdiet.engine.request import RequestOutput
from kvdiet.engine.sampling import SamplingParams
from kvdiet.server.errors import ApiError, AsciiJSONResponse
from kvdiet.server.metrics import CONTENT_TYPE, ServerMetrics
from kvdiet.server.protocol import ChatCompletionRequest, CompletionRequest, _Common, error_body
from kvdiet.server.streaming import final_output, sse_response, usage_body
from kvdiet.tokenizer import HELD_CHARS

__all__ = ["ServerContext", "router"]

_COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default max_tokens of /v1/completions
_long_texts = ThreadPoolExecutor(
    max_workers=1, thread_name_prefix="kvdiet-long-text"
)  # prompts past HELD_CHARS
_DEFAULT_ORIGIN = "the default when a completion gives none"  # named in a length refusal


@dataclass(frozen=True, slots=True)
class ServerContext:
    """What the handlers need, kept at ``app.state.server``.

    Attributes:
        loop: the engine loop every request runs on.
        model_name: the name clients must use in ``model``.
        metrics: the registry behind ``/metrics``.
        default_max_tokens: chat ``max_tokens`` (tokens) when a request gives none, capped by the context left.
    """

    loop: EngineLoop
    model_name: str
    metrics: ServerMetrics
    default_max_tokens: int


def _context(request: Request) -> ServerContext:
    return request.app.state.server


Context = Annotated[ServerContext, Depends(_context)]

router = APIRouter()


# HEAD (a load balancer's probe) out of the schema: OpenAPI gives each operation an id of its own, and FastAPI
# names GET and HEAD of one function alike
@router.get("/health")
@router.head("/health", include_in_schema=False)
async def health(ctx: Context) -> Response:
    if ctx.loop.healthy:
        return Response(status_code=200)
    return AsciiJSONResponse(
        error_body("the engine is not running", status=503, kind="service_unavailable"), 503
    )


@router.get("/metrics")
async def prometheus(ctx: Context) -> Response:
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models")
@router.head("/v1/models", include_in_schema=False)
async def models(ctx: Context) -> dict:
    return {"object": "list", "data": [_model_card(ctx)]}


@router.get("/v1/models/{model_id:path}")  # a name may hold slashes (a --weights path)
async def model(model_id: str, ctx: Context) -> dict:
    """One model's card (what the OpenAI SDK's ``models.retrieve`` asks for); 404 for another name."""
    if model_id != ctx.model_name:
        raise ApiError(
            f"the model {model_id!r} does not exist; this server serves {ctx.model_name!r}",
            param="model",
            status=404,
        )
    return _model_card(ctx)


def _model_card(ctx: ServerContext) -> dict:
    return {
        "id": ctx.model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "kvdiet",
        "max_model_len": ctx.loop.engine.max_model_len,
    }


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, ctx: Context) -> Response:
    _check_common(ctx, body)
    try:
        prompt = body.single_prompt()
    except ValueError as exc:
        raise ApiError(str(exc), param="prompt") from None
    params = _sampling(body, body.max_tokens if body.max_tokens is not None else _COMPLETIONS_MAX_TOKENS)
    sent = body.max_tokens is not None and "max_tokens" in body.model_fields_set
    prepared = await _prepare(ctx, prompt, params, max_tokens_origin="" if sent else _DEFAULT_ORIGIN)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    # a model without a tokenizer has no text to give (vLLM's skip_tokenizer_init leaves it empty): its ids
    # come back as if return_token_ids were set, so the output is never just ""
    with_ids = body.return_token_ids or ctx.loop.engine.tokenizer is None

    def chunk(out: RequestOutput, *, final: bool = False) -> dict:
        choice = {
            "index": 0,
            "text": out.text if final else out.new_text,
            "logprobs": None,
            "finish_reason": _finish_reason(out),
            "stop_reason": out.stop_reason,
        }
        if with_ids:
            choice["token_ids"] = list(out.output_ids if final else out.new_token_ids)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": ctx.model_name,
            "choices": [choice],
        } | ({"prompt_token_ids": list(prepared.prompt_ids)} if with_ids and final else {})

    def final(out: RequestOutput) -> dict:
        return chunk(out, final=True) | {"usage": usage_body(out)}

    return await _respond(ctx, body, request, prepared, rid, created, "text_completion", chunk, final)


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, request: Request, ctx: Context) -> Response:
    _check_common(ctx, body)
    engine = ctx.loop.engine
    if engine.tokenizer is None:
        raise ApiError("this model has no tokenizer, so no chat template: use /v1/completions with token ids")
    wanted = body.max_completion_tokens or body.max_tokens
    origin = ""  # a length refusal names a max_tokens the client did not send as such
    if body.max_completion_tokens is not None:
        origin = "sent as max_completion_tokens"
    elif wanted is None:
        origin = "the least a reply takes"
    try:
        thinking = chat_thinking(body.chat_template_kwargs)
        messages = [m.model_dump() for m in body.messages]
        fit = (engine.max_model_len, wanted or 1, origin)  # text that cannot fit is refused untokenized
        size = sum(len(str(m.get("content") or "")) for m in messages)
        prompt_ids = await _prepared_in_worker(
            size, chat_prompt_ids, engine.tokenizer, messages, thinking=thinking, fit=fit
        )
    except ContextLengthError as exc:
        raise ApiError(str(exc), param="messages") from None
    except InvalidRequestError as exc:
        raise ApiError(str(exc), param=exc.param) from None
    room = engine.max_model_len - len(prompt_ids)
    # unasked, the reply takes the context left, at most --default-max-tokens; a prompt that fills the context
    # is refused for the one token any reply takes, in the words of every other length refusal
    max_tokens = wanted if wanted is not None else max(1, min(ctx.default_max_tokens, room))
    params = _sampling(body, max_tokens)
    prepared = await _prepare(ctx, prompt_ids, params, field="messages", max_tokens_origin=origin)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())

    def event(delta: dict[str, Any], finish_reason: str | None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": ctx.model_name,
            "choices": [choice],
        }

    def chunk(out: RequestOutput) -> dict:
        sent = event({"content": out.new_text}, _finish_reason(out))
        if body.return_token_ids:
            sent["choices"][0]["token_ids"] = list(out.new_token_ids)
        return sent

    def final(out: RequestOutput) -> dict:
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": ctx.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": out.text},
                    "logprobs": None,
                    "finish_reason": _finish_reason(out),
                    "stop_reason": out.stop_reason,
                }
                | ({"token_ids": list(out.output_ids)} if body.return_token_ids else {})
            ],
            "usage": usage_body(out),
        } | ({"prompt_token_ids": list(prepared.prompt_ids)} if body.return_token_ids else {})

    opening = event({"role": "assistant", "content": ""}, None)  # the role alone first, as OpenAI and vLLM
    return await _respond(
        ctx, body, request, prepared, rid, created, "chat.completion.chunk", chunk, final, opening=opening
    )


async def _respond(
    ctx: ServerContext,
    body: _Common,
    request: Request,
    prepared: PreparedRequest,
    rid: str,
    created: int,
    kind: str,
    chunk: Callable[[RequestOutput], dict],
    final: Callable[[RequestOutput], dict],
    *,
    opening: dict | None = None,
) -> Response:
    """Run the request: with ``stream``, server-sent events of ``opening`` (if given) then ``chunk(out)``
    (``kind`` names the usage chunk's object); else ``final(out)`` of the last output as JSON, or 499 when the
    client left first."""
    if body.stream:
        return sse_response(
            ctx.loop,
            prepared,
            rid,
            chunk,
            include_usage=_include_usage(body),
            created=created,
            model_name=ctx.model_name,
            kind=kind,
            opening=opening,
        )
    out = await final_output(ctx.loop, prepared, rid, request)
    if out is None:
        return Response(status_code=499)  # the client closed the connection (nginx's code)
    return AsciiJSONResponse(final(out))


def _check_common(ctx: ServerContext, body: _Common) -> None:
    """The checks every generation route shares: model name (404 for another, as OpenAI and vLLM answer),
    unsupported fields, stream options, a live engine (503 otherwise)."""
    if body.model is not None and body.model != ctx.model_name:
        raise ApiError(
            f"the model {body.model!r} does not exist; this server serves {ctx.model_name!r}",
            param="model",
            status=404,
        )
    problem = body.unsupported()
    if problem is not None:
        raise ApiError(problem[0], param=problem[1])
    if body.stream_options is not None and not body.stream:
        raise ApiError("stream_options is only allowed with stream: true", param="stream_options")
    if not ctx.loop.healthy:
        raise ApiError("the engine is not running", status=503, kind="service_unavailable")


async def _prepare(
    ctx: ServerContext,
    prompt: str | list[int],
    params: SamplingParams,
    *,
    field: str = "prompt",
    max_tokens_origin: str = "",
) -> PreparedRequest:
    """Validate the request once (`LLMEngine.prepare`); a refusal is a 400 whose ``param`` is the field that
    caused it (`InvalidRequestError.param`: ``stop``, ``stop_token_ids``, ``logit_bias``), with the prompt's
    faults (length included) named as ``field`` (the request's ``prompt`` or ``messages``). A length refusal
    (`ContextLengthError`) also names, beside a max_tokens the client did not send as ``max_tokens`` (a
    default, or a chat's ``max_completion_tokens``), ``max_tokens_origin``. Runs in a worker thread
    (`LLMEngine.prepare` is thread-safe): tokenizing a long prompt never holds up the event loop."""
    try:
        size = len(prompt) if isinstance(prompt, str) else 0
        return await _prepared_in_worker(size, ctx.loop.engine.prepare, prompt, params)
    except ContextLengthError as exc:
        message = str(exc.with_origin(max_tokens_origin) if max_tokens_origin else exc)
        raise ApiError(message, param=field) from None
    except InvalidRequestError as exc:
        raise ApiError(str(exc), param=field if exc.param == "prompt" else exc.param) from None


def _sampling(body: _Common, max_tokens: int) -> SamplingParams:
    """The body's `SamplingParams`; a refusal is a 400 naming the body field its message starts with."""
    try:
        return body.sampling_params(max_tokens)
    except ValueError as exc:
        # a logit_bias key that is not a token id, an empty stop string: the message starts with the field
        field = str(exc).split(" ", 1)[0]
        raise ApiError(str(exc), param=field if field in type(body).model_fields else None) from None


def _finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finished else None


def _include_usage(body: _Common) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


async def _prepared_in_worker(size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a worker thread: a prompt of more than `HELD_CHARS` characters (``size``)
    on the one thread kept for long texts, then the memory its tokenizing freed handed back to the system
    (`_trim`), the rest in asyncio's default pool. A long text can take a minute and gigabytes (one with no place
    to cut, `Tokenizer.encode`): queued on their own thread, ten of them hold none of the default pool's six
    threads (on 2 cores), which every other request's preparation needs (a 5-token prompt waited 17 s behind ten
    4.5 MB ones), and their memory is one thread's, returned after each (8 sequential 30 MB prompts left 10.6 GB
    resident, spread over the pool's threads)."""
    if size <= HELD_CHARS:
        return await asyncio.to_thread(fn, *args, **kwargs)

    def run() -> Any:
        try:
            return fn(*args, **kwargs)
        finally:
            _trim()

    return await asyncio.get_running_loop().run_in_executor(_long_texts, run)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None (another C library)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def _trim() -> None:
    """Free heap memory handed back to the system where the C library can (glibc's ``malloc_trim(0)``)."""
    if (trim := _malloc_trim()) is not None:
        trim(0)
