"""The engine: requests in, one scheduled step at a time, outputs out.

`LLMEngine` owns the request table, the `Scheduler` and the cache system (`ModelRunner`). A step:
1. the scheduler plans it (decodes of running requests, prefill chunks, admissions, preemptions);
2. prefill chunks run one request at a time (`ModelRunner.prefill`, which also splits at the policy's
   capture points); a request whose prompt is complete samples its first token;
3. every decoding request feeds its pending token in one batched forward (`ModelRunner.decode`) and samples;
4. stop conditions (stop token ids, EOS unless ``ignore_eos``, stop strings, ``max_tokens``) end
   requests; their sessions finish (window state stored per the policy, blocks back to the pool).

Preemption ends the session with `ModelRunner.finish`, so the window snapshot at the last block boundary it
reached is stored (SWA pool under bounded replay): on resumption the prompt plus the outputs so far are
looked up again, the blocks still cached are reused and, while the snapshot lives, the continuation is
exact.

The engine is single-threaded: one caller (the `EngineLoop` thread, or `LLM`) drives it. `prepare` is the
edge that validates a request, once (`kvdiet.engine.prepared`); it only reads the model config and the
tokenizer and may be called from any thread. `add_prepared` and everything below it trust its result.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvdiet.engine.detokenizer import IncrementalDetokenizer, find_stop, safe_length
from kvdiet.engine.max_model_len import check_max_model_len
from kvdiet.engine.prepared import (
    InvalidRequestError,
    PreparedRequest,
    check_sampling_ids,
    fit_context_length,
)
from kvdiet.engine.request import FinishReason, Request, RequestOutput, RequestStatus
from kvdiet.engine.runner import ModelRunner
from kvdiet.engine.sampling import SamplingParams, sample, sampling_generator
from kvdiet.engine.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from kvdiet.model.token_ids import check_vocab_ids
from kvdiet.model.transformer import Transformer
from kvdiet.tokenizer import Tokenizer, TooManyTokensError

__all__ = ["EngineObserver", "EngineStats", "LLMEngine"]

log = logging.getLogger("kvdiet.engine")


class EngineObserver(Protocol):
    """Receives timing events from the engine thread (the server's Prometheus metrics implement it)."""

    def on_first_token(self, request: Request, ttft_s: float) -> None: ...

    def on_token(self, request: Request, itl_s: float) -> None: ...

    def on_finish(self, request: Request) -> None: ...


@dataclass(slots=True)
class EngineStats:
    """Engine-level counters (requests and tokens; the cache's own counters are in `ModelRunner.stats`)."""

    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission)
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in FinishReason})
    steps: int = 0


class LLMEngine:
    """Continuous-batching engine over one model and its cache system.

    Args:
        model: the V4.1 model.
        runner: its open `ModelRunner` (the cache system: device pool, prefix cache, tiers, policy).
        tokenizer: for text prompts, output text and stop strings (None: token ids only).
        max_model_len: longest prompt + output (tokens); default the config's ``max_position_embeddings``.
        scheduler: batching limits.
        observer: optional timing observer (metrics).

    Logs one warning (logger ``kvdiet.engine``) when ``runner`` reuses no short prefix for want of a
    persistent tier (`ModelRunner.unstored_window_warning`).
    Raises:
        ValueError: ``max_model_len`` out of range, or one request of ``max_model_len`` tokens would not fit
            the device pool (the message gives both sizes, like vLLM's start-up check).
    """

    def __init__(
        self,
        model: Transformer,
        runner: ModelRunner,
        *,
        tokenizer: Tokenizer | None = None,
        max_model_len: int | None = None,
        scheduler: SchedulerConfig | None = None,
        observer: EngineObserver | None = None,
    ) -> None:
        self.max_model_len = check_max_model_len(
            max_model_len,
            limit=model.cfg.max_position_embeddings,
            block_size=runner.options.block_size,
            num_blocks=runner.pool.blocks.num_blocks,
            block_bytes=runner.pool.block_bytes,
        )
        self.model, self.runner, self.tokenizer = model, runner, tokenizer
        self.observer = observer
        self.scheduler = Scheduler(scheduler or SchedulerConfig(), _CacheOracle(runner))
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._eos = tokenizer.eos_token_id if tokenizer is not None else None
        if (warning := runner.unstored_window_warning()) is not None:
            log.warning(warning)

    # --- requests in ---

    def prepare(self, prompt: str | Sequence[int], params: SamplingParams) -> PreparedRequest:
        """Validate a request once, at the edge, and return it prepared (text gets BOS prepended); what the
        layers below may then assume is in `kvdiet.engine.prepared`. Thread-safe (reads only the model
        config and the tokenizer).

        Raises:
            InvalidRequestError (a ValueError; ``param`` names the field), in this order: stop or logit-bias
                ids outside the vocabulary; empty prompt; text without a tokenizer; text that is not valid
                Unicode; a token id outside the vocabulary (index and size named); stop strings without a
                tokenizer; prompt + max_tokens > max_model_len, a prompt past ``max_position_embeddings`` too
                (`ContextLengthError`: its numbers as attributes and in the message; a text whose
                `Tokenizer.least_tokens` cannot fit already is refused before it is tokenized, ``at_least``).
        """
        check_sampling_ids(params, self.model.cfg.vocab_size)
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError(
                    "empty prompt: give at least one character or token id", param="prompt"
                )
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer: give the prompt as token ids", param="prompt"
                )
            # a long text whose tokens cannot fit is refused before it is tokenized (seconds and gigabytes)
            if least := self.tokenizer.least_tokens(prompt, enough=self.max_model_len):
                fit_context_length(1 + least, params, self.max_model_len, "max_model_len", at_least=True)
            # tokenizing stops once the tokens cannot fit with BOS and the reply (the one token at least)
            most = self.max_model_len - 1 - (1 if params.max_tokens is None else params.max_tokens)
            try:
                ids = [self.tokenizer.bos_token_id, *self.tokenizer.encode(prompt, most=max(0, most))]
            except TooManyTokensError as exc:
                fit_context_length(
                    1 + exc.at_least, params, self.max_model_len, "max_model_len", at_least=True
                )
                raise AssertionError("a prompt past its most fits") from None  # fit_context_length raised
            except ValueError as exc:  # not valid Unicode (an unpaired surrogate)
                raise InvalidRequestError(str(exc), param="prompt") from None
        else:
            try:
                ids = check_vocab_ids(self.model.cfg, list(prompt)).tolist()  # the length: below
            except ValueError as exc:
                raise InvalidRequestError(str(exc), param="prompt") from None
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError(
                "stop strings need a tokenizer; this model has none (use stop_token_ids)", param="stop"
            )
        params = fit_context_length(len(ids), params, self.max_model_len, "max_model_len")
        return PreparedRequest(tuple(ids), params)

    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams, *, request_id: str | None = None
    ) -> str:
        """Validate (`prepare`) and queue a request; returns its id.

        Raises:
            ValueError: invalid request (`InvalidRequestError`; nothing changes), or a duplicate ``request_id``.
        """
        return self.add_prepared(self.prepare(prompt, params), request_id=request_id)

    def add_prepared(self, request: PreparedRequest, *, request_id: str | None = None) -> str:
        """Queue a request already validated by `prepare` (not checked again); returns its id.

        Raises:
            ValueError: a duplicate ``request_id`` (nothing changes).
        """
        ids, params = list(request.prompt_ids), request.params
        assert ids and len(ids) + params.max_tokens <= self.max_model_len, "not prepared by this engine"
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        req = Request(
            rid,
            ids,
            params,
            time.monotonic(),
            sampling_generator(seed),
            IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)
            if self.tokenizer is not None and params.detokenize
            else None,
        )
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now (waiting or running): its blocks go back to the pool, no window state is
        stored. Returns its final output, or None when the id is unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status is not RequestStatus.FINISHED or req.session is not None:
            self.scheduler.remove(req)
        if req.session is not None:
            self.runner.abort(req.session)
            req.session = None
        if req.finished:  # finished inside a step that then raised: released now, reported already or never
            del self.requests[request_id]
            return None
        return self._finish(req, FinishReason.ABORT)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # --- one step ---

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; returns an output for every request that produced tokens or finished."""
        plan: ScheduledStep = self.scheduler.schedule()
        touched: list[Request] = []
        for req in (r for r, _ in plan.prefills):
            if req.first_provenance is None:
                req.first_provenance = req.session.provenance
                self.stats.prompt_tokens += req.num_prompt_tokens
        for req, n in plan.prefills:
            logits = self.runner.prefill(req.session, chunk_size=n, max_tokens=n)
            if not req.is_prefilling:
                self._accept(req, logits)
                touched.append(req)
        if plan.decodes:
            logits = self.runner.decode(
                [r.session for r in plan.decodes], [r.pending_token for r in plan.decodes]
            )
            for req, row in zip(plan.decodes, logits, strict=True):
                self._accept(req, row)
                touched.append(req)
        self.stats.steps += 1
        outputs = []
        for req in touched:
            if req.finished:
                self.scheduler.remove(req)
                self.runner.finish(req.session)
                req.session = None
                outputs.append(self._output(req))
            elif req.emitted_tokens < len(req.output_ids):
                outputs.append(self._output(req))
        return outputs

    def _accept(self, req: Request, logits: torch.Tensor) -> None:
        """Sample the next token from ``logits`` [V] and apply the stop conditions."""
        p = req.params
        if len(req.output_ids) >= p.max_tokens:  # max_tokens = 0: the prompt is scored, nothing sampled
            self._end(req, FinishReason.LENGTH)
            return
        token = sample(logits, p, req.generator)
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
            if self.observer is not None:
                self.observer.on_first_token(req, now - req.arrival_time)
        elif self.observer is not None:
            self.observer.on_token(req, now - req.last_token_time)
        req.last_token_time = now
        req.output_ids.append(token)
        self.stats.generation_tokens += 1
        req.pending_token = token
        stop_token = token in p.stop_token_ids or (token == self._eos and not p.ignore_eos)
        if req.detokenizer is not None and not stop_token:  # a stop token's own text is left out
            req.detokenizer.add(token)
            text = req.detokenizer.text
            start = max(0, req.emitted_text - max(map(len, p.stop), default=0))
            found = find_stop(text, p.stop, start, include=p.include_stop_str_in_output)
            if found is not None:
                req.text, req.stop_reason = text[: found[0]], found[1]
                self._end(req, FinishReason.STOP, flush=False)  # held-back ids lie past the cut
                return
            req.text = text
        if stop_token:  # a stop token id is the reason; the EOS token is none (vLLM's stop_reason)
            req.stop_reason = None if token == self._eos and not p.ignore_eos else token
            self._end(req, FinishReason.STOP)
        elif len(req.output_ids) >= p.max_tokens:
            self._end(req, FinishReason.LENGTH)

    def _end(self, req: Request, reason: FinishReason, *, flush: bool = True) -> None:
        if req.detokenizer is not None and flush:
            req.detokenizer.flush()  # ids held back for an incomplete character
            req.text = req.detokenizer.text
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        self.stats.finished[reason.value] += 1
        if self.observer is not None:
            self.observer.on_finish(req)

    def _finish(self, req: Request, reason: FinishReason) -> RequestOutput:
        self._end(req, reason)
        return self._output(req)

    def _output(self, req: Request) -> RequestOutput:
        stops = () if req.params.include_stop_str_in_output else req.params.stop  # kept: nothing to hold back
        upto = len(req.text) if req.finished else safe_length(req.text, stops)
        upto = max(upto, req.emitted_text)
        new_text = req.text[req.emitted_text : upto]
        new_ids = tuple(req.output_ids[req.emitted_tokens :])
        req.emitted_text, req.emitted_tokens = upto, len(req.output_ids)
        if req.finished:
            del self.requests[req.request_id]
        return RequestOutput(
            req.request_id,
            req.num_prompt_tokens,
            new_ids,
            new_text,
            tuple(req.output_ids),
            req.text,
            req.finished,
            req.finish_reason.value if req.finish_reason is not None else None,
            req.first_provenance,
            req.num_preemptions,
            (req.first_token_time - req.arrival_time) if req.first_token_time is not None else None,
            req.stop_reason,
        )

    # --- whole runs ---

    def run_to_completion(self, on_output: Callable[[RequestOutput], None] | None = None) -> None:
        """Step until no request is left; ``on_output`` sees every output."""
        while self.has_unfinished:
            for out in self.step():
                if on_output is not None:
                    on_output(out)


class _CacheOracle:
    """`BlockOracle` on a `ModelRunner` (the scheduler's only view of the cache)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.block_size = runner.options.block_size

    @property
    def num_free_blocks(self) -> int:
        return self.runner.pool.blocks.num_free

    def admission_blocks(self, request: Request) -> int:
        return self.runner.admission_blocks(request.all_ids, int(request.decodes_after_prefill))

    def begin(self, request: Request) -> None:
        ids = request.all_ids
        request.session = self.runner.start(ids)
        request.prefill_target = len(ids)
        request.pending_token = None

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        state = request.session.state
        return max(
            0, -(-(state.num_tokens + num_tokens) // self.runner.options.block_size) - len(state.table)
        )

    def preempt(self, request: Request) -> None:
        self.runner.finish(request.session)
        request.session = None
