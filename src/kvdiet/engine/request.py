"""A request inside the engine, and what the engine reports about it after each step.

`Request` is the engine's bookkeeping for one generation: token ids, sampling parameters, where it is in
its life (waiting → running → finished, with preemption back to waiting), timings, and the cache
`Session` while it holds device blocks. `RequestOutput` is the immutable view handed to callers (the LLM
API, the server) after a step. This module knows nothing of tensors or of the model.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvdiet.engine.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

    from kvdiet.cache.plan import Provenance
    from kvdiet.engine.detokenizer import IncrementalDetokenizer
    from kvdiet.engine.session import Session

__all__ = ["FinishReason", "Request", "RequestOutput", "RequestStatus"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not holding blocks: new, or preempted
    RUNNING = "running"  # holds a cache session: prefilling or decoding
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    """Why a request ended (the OpenAI ``finish_reason`` values, plus ``abort``)."""

    STOP = "stop"  # a stop token id, the EOS token or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # aborted by the caller (e.g. a client that disconnected)


@dataclass(slots=True)
class Request:
    """One generation request (engine-internal, mutated only by the engine thread).

    Attributes:
        request_id: unique id given by the caller.
        prompt_ids: the prompt's token ids (never changed).
        params: sampling parameters.
        arrival_time: `time.monotonic()` seconds when it was added.
        generator: its sampling RNG (seeded from ``params.seed``; kept across preemptions).
        detokenizer: its incremental detokenizer (None without a tokenizer, or with ``params.detokenize`` False).
        output_ids: tokens generated so far.
        status / finish_reason: where it is; why it ended.
        session: its cache session while RUNNING (holds device blocks), else None.
        prefill_target: tokens the current session must prefill before sampling: the prompt, or after a
            preemption the prompt plus every output so far (the next token is sampled from its last row).
        pending_token: a sampled token not yet fed to the model (the next decode input), or None.
        first_provenance: where the prompt's tokens came from at its first admission (``usage`` reports it;
            a resumption's own lookup and replay show only in the cache counters).
        num_preemptions: times it lost its blocks and went back to the queue.
        first_token_time / last_token_time: `time.monotonic()` of the first and latest output token.
        stop_reason: the stop token id or stop string it finished on (None: EOS, length, abort, or running).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer | None = None
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    session: Session | None = None
    prefill_target: int = 0
    pending_token: int | None = None
    first_provenance: Provenance | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    text: str = ""  # output text so far (with a tokenizer)
    emitted_text: int = 0  # characters of ``text`` already reported (stop-string hold-back)
    emitted_tokens: int = 0  # output ids already reported
    stop_reason: int | str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def all_ids(self) -> list[int]:
        """Prompt then outputs: what the model has seen or will see (token ids)."""
        return self.prompt_ids + self.output_ids

    @property
    def decodes_after_prefill(self) -> bool:
        """Whether the token sampled after prefilling ``all_ids`` may be fed back by a decode step: False
        when it is the last one ``max_tokens`` allows (or ``max_tokens`` is 0), so no KV slot is needed
        for it."""
        return len(self.output_ids) + 1 < self.params.max_tokens

    @property
    def is_prefilling(self) -> bool:
        """RUNNING and still short of ``prefill_target`` tokens in its session."""
        return self.session is not None and self.session.state.num_tokens < self.prefill_target

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request (the unit the LLM API and the server stream).

    Attributes:
        request_id: the caller's id.
        prompt_tokens: prompt length (tokens).
        new_token_ids / new_text: output produced since the previous `RequestOutput` of this request (text
            withheld while it could still become a stop string).
        output_ids / text: the whole output so far.
        finished / finish_reason: whether it ended and why (``"stop"``, ``"length"``, ``"abort"``).
        provenance: where the prompt's tokens came from (device / persistent / window source / replayed).
        num_preemptions: times it was preempted.
        ttft_s: seconds from arrival to the first output token (None before it).
        stop_reason: the stop token id (int) or stop string (str) that ended it; None for the EOS token, a
            length, an abort or a running request (vLLM's ``stop_reason``).
    """

    request_id: str
    prompt_tokens: int
    new_token_ids: tuple[int, ...]
    new_text: str
    output_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: str | None
    provenance: Provenance | None
    num_preemptions: int
    ttft_s: float | None
    stop_reason: int | str | None = None

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose global KV came from a cache tier (0 before admission)."""
        return self.provenance.hit_tokens if self.provenance is not None else 0
