"""Single-request generation through the cache system: validate the request, look the prompt up, prefill,
decode.

The offline path behind ``kvdiet generate``: one request at a time through a `ModelRunner` (device pool, prefix
cache, persistent tier, SWA pool, replay). Batching, scheduling and the server come from the engine proper.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvdiet.cache.plan import Provenance
from kvdiet.engine.prepared import (
    InvalidRequestError,
    PreparedRequest,
    check_sampling_ids,
    fit_context_length,
)
from kvdiet.engine.progress import DEFAULT_INTERVAL_S, StepProgress
from kvdiet.engine.runner import CacheOptions, ModelRunner
from kvdiet.engine.sampling import SamplingParams, sample, sampling_generator
from kvdiet.model.state import CacheBytes
from kvdiet.model.token_ids import check_vocab_ids
from kvdiet.model.transformer import Transformer

__all__ = ["GenerateResult", "check_request", "generate", "generate_prepared", "private_runner"]


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """What one generation did.

    Attributes:
        prompt_tokens: prompt length in tokens.
        output_ids: generated token ids.
        finish_reason: ``"stop"`` (a stop token) or ``"length"`` (max_tokens reached).
        prefill_seconds / decode_seconds: wall time of each phase (prefill includes the prefix lookup,
            loads from the persistent tier, restore or replay).
        cache: measured cache bytes at the end.
        provenance: where the prompt's tokens came from (device, persistent, SWA pool, replayed, computed).
    """

    prompt_tokens: int
    output_ids: list[int]
    finish_reason: str
    prefill_seconds: float
    decode_seconds: float
    cache: CacheBytes
    provenance: Provenance

    @property
    def prefill_computed_tokens_per_second(self) -> float:
        """Tokens the prefill ran through the model (computed past the hit, plus any replayed below it) per
        second of prefill; a cache hit's tokens are not in it (they were loaded, not computed)."""
        p = self.provenance
        tokens = p.computed_tokens + p.replayed_tokens
        return tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Tokens the decode steps made per second of the decode phase: every token but the first (the prefill's
        logits give it); None where no decode step ran (one token or none)."""
        steps = len(self.output_ids) - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else None


def check_request(
    model: Transformer, prompt_ids: Sequence[int], params: SamplingParams, *, max_model_len: int | None = None
) -> PreparedRequest:
    """Validate a prompt and its sampling parameters for ``model``, once (the offline edge; the contract is
    in `kvdiet.engine.prepared`). ``max_model_len``: the longest prompt + output in tokens (None, or more than
    the config's ``max_position_embeddings``: that limit, named).

    Raises:
        InvalidRequestError (a ValueError): stop ids outside the vocabulary, bad token ids (see
            `kvdiet.model.token_ids.check_vocab_ids`), or a prompt plus ``max_tokens`` beyond the limit
            (`ContextLengthError`: the real numbers and the limit's name in the message).
    """
    check_sampling_ids(params, model.cfg.vocab_size)
    try:
        ids = check_vocab_ids(model.cfg, prompt_ids).tolist()  # the length: fit_context_length
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="prompt") from None
    most = model.cfg.max_position_embeddings  # a larger max_model_len does not lift it
    limit, name = (
        (most, "max_position_embeddings")
        if max_model_len is None or max_model_len > most
        else (max_model_len, "max_model_len")
    )
    return PreparedRequest(tuple(ids), fit_context_length(len(ids), params, limit, name))


def private_runner(model: Transformer, num_tokens: int, options: CacheOptions | None = None) -> ModelRunner:
    """A `ModelRunner` with a device pool just large enough for one request of ``num_tokens`` tokens."""
    opts = (options or CacheOptions()).for_model(v4_flash=not model.cfg.is_v41)
    probe = model.new_pool(1, block_size=opts.block_size)
    blocks = -(-num_tokens // opts.block_size) + 1
    return ModelRunner(model, dataclasses.replace(opts, kv_cache_memory=blocks * probe.block_bytes))


def generate(
    model: Transformer,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    cache: ModelRunner | None = None,
    chunk_size: int = 512,
    progress: bool = False,
    progress_interval_s: float = DEFAULT_INTERVAL_S,
) -> GenerateResult:
    """Validate ``prompt_ids`` with ``params`` (`check_request`), then `generate_prepared`.

    Raises:
        ValueError: an invalid prompt or parameters (`InvalidRequestError`), or see `generate_prepared`.
        NoFreeBlocksError: the device pool cannot hold the request.
    """
    return generate_prepared(
        model,
        check_request(model, prompt_ids, params),
        cache=cache,
        chunk_size=chunk_size,
        progress=progress,
        progress_interval_s=progress_interval_s,
    )


def generate_prepared(
    model: Transformer,
    request: PreparedRequest,
    *,
    cache: ModelRunner | None = None,
    chunk_size: int = 512,
    progress: bool = False,
    progress_interval_s: float = DEFAULT_INTERVAL_S,
) -> GenerateResult:
    """Look a validated request's prompt up in ``cache``, prefill the rest in chunks of ``chunk_size`` tokens,
    then decode up to ``params.max_tokens``; the blocks go back to the pool (and window state to its tier)
    at the end. The request is not checked again (`kvdiet.engine.prepared`).

    Args:
        request: from `check_request` for this ``model``.
        cache: the cache system (an open `ModelRunner`); None → a private one without tiers, sized for this
            request.
        progress: report the prefill on stderr (`StepProgress`: a bar on a terminal, else a line every
            ``progress_interval_s`` seconds).
    Raises:
        ValueError: bad ``chunk_size`` (before any state or tier changes).
        NoFreeBlocksError: the device pool cannot hold the request.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    ids, params = list(request.prompt_ids), request.params
    if cache is None:
        cache = private_runner(model, len(ids) + params.max_tokens)
    start = time.perf_counter()
    session = cache.start(ids)
    try:
        done = session.state.num_tokens
        with StepProgress(len(ids), done=done, enabled=progress, interval_s=progress_interval_s) as bar:
            logits = cache.prefill(session, chunk_size=chunk_size, progress=bar)
        prefill_s = time.perf_counter() - start
        generator = sampling_generator(params.seed or 0)
        out: list[int] = []
        finish = "length"
        start = time.perf_counter()
        while len(out) < params.max_tokens:
            token = sample(logits, params, generator)
            out.append(token)
            if token in params.stop_token_ids:
                finish = "stop"
                break
            if len(out) < params.max_tokens:
                logits = cache.decode([session], [token])[0]
        decode_s = time.perf_counter() - start
        measured = session.state.cache_bytes()
    except BaseException:
        cache.abort(session)
        raise
    cache.finish(session)
    return GenerateResult(len(ids), out, finish, prefill_s, decode_s, measured, session.provenance)
