"""Running one request for an HTTP response: to its final output (`final_output`, which notices a client
that leaves) or as server-sent events (`sse_response`), and the OpenAI ``usage`` object (`usage_body`).

Either way, a client that disconnects aborts the request: its blocks return to the pool at the next step
boundary. ``usage`` carries ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` and
``prompt_tokens_details``: ``cached_tokens`` (prompt tokens whose KV came from a cache tier) split into
``device_tokens``, ``global_pool_tokens`` and ``persistent_tokens``, plus ``window_source`` and
``replayed_tokens`` (how the window state at the hit was rebuilt).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvdiet.engine.loop import EngineDeadError, EngineLoop
from kvdiet.engine.prepared import PreparedRequest
from kvdiet.engine.request import RequestOutput
from kvdiet.server.errors import ApiError
from kvdiet.server.protocol import error_body

__all__ = ["final_output", "sse_response", "usage_body"]

_DISCONNECT_POLL_S = 0.5


def usage_body(out: RequestOutput) -> dict:
    """The OpenAI ``usage`` object of a request's last output (token counts; see the module docstring)."""
    p = out.provenance
    details: dict[str, Any] = {"cached_tokens": out.cached_tokens}
    if p is not None:
        details |= {
            "device_tokens": p.device_tokens,
            "global_pool_tokens": p.global_pool_tokens,
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


async def final_output(
    loop: EngineLoop, prepared: PreparedRequest, rid: str, request: Request
) -> RequestOutput | None:
    """Run a request to its end; a client that disconnects first aborts it (then None: nobody to answer).

    Raises:
        ApiError: 503 when the engine is not serving or failed; 400 when it refused the request.
    """

    async def consume() -> RequestOutput:
        last = None
        async with contextlib.aclosing(loop.generate(prepared, request_id=rid)) as outputs:
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
        raise ApiError(str(exc), status=503, kind="service_unavailable") from None
    except ValueError as exc:
        raise ApiError(str(exc)) from None
    finally:
        if not task.done():
            task.cancel()


def sse_response(
    loop: EngineLoop,
    prepared: PreparedRequest,
    rid: str,
    chunk: Callable[[RequestOutput], dict],
    *,
    include_usage: bool,
    created: int,
    model_name: str,
    kind: str,
    opening: dict | None = None,
) -> StreamingResponse:
    """Server-sent events: ``opening`` if given (a chat's role-only first chunk, as OpenAI and vLLM send it),
    ``chunk(out)`` per output, the usage chunk if asked (``kind`` is its ``object``, ``created`` its Unix time in
    seconds), then ``[DONE]``; an engine failure or refusal is one error event before ``[DONE]``. A disconnect
    cancels the generator, which aborts the request."""

    async def events() -> AsyncIterator[str]:
        last = None
        if opening is not None:
            yield f"data: {json.dumps(opening)}\n\n"
        try:
            async with contextlib.aclosing(loop.generate(prepared, request_id=rid)) as outputs:
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
                yield f"data: {json.dumps(usage | {'usage': usage_body(last)})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
