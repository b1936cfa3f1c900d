"""`PreparedRequest`: a request validated once, at the edge, and what the layers below it may assume.

The edges are `LLMEngine.prepare` (the engine, `kvdiet.LLM`, the server's routes) and
`kvdiet.engine.generate.check_request` (offline ``kvdiet generate``). Each checks a prompt and its sampling
parameters once, before any state changes, and either raises `InvalidRequestError` or returns a
`PreparedRequest`. Everything below the edge (the engine loop, `LLMEngine.add_prepared`, the scheduler,
`ModelRunner.start`, the model's prefill) takes such a request as checked and does not check it again:

- ``prompt_ids`` is non-empty and every id is an ``int`` in ``[0, vocab_size)`` of the model's config;
- ``params.max_tokens`` is an int (None, "the context left", resolved at the edge) and
  ``len(prompt_ids) + params.max_tokens`` is at most the context limit of the edge (the engine's
  ``max_model_len``, itself at most the config's ``max_position_embeddings``; offline, the latter), so
  every later `ModelRunner.start` of the prompt plus the outputs so far (a resumption after preemption) stays
  within it too;
- every stop and logit-bias token id of ``params`` is in the vocabulary, and stop strings come only with a
  tokenizer (engine edge).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvdiet.engine.sampling import SamplingParams
from kvdiet.units import format_count, format_tokens

__all__ = [
    "ContextLengthError",
    "InvalidRequestError",
    "PreparedRequest",
    "check_sampling_ids",
    "fit_context_length",
]


class InvalidRequestError(ValueError):
    """A request refused at the edge, before any state changed.

    Attributes:
        param: the request field at fault: ``"prompt"`` (empty, a token id outside the vocabulary, too long
            for the context, text without a tokenizer), ``"stop_token_ids"`` or ``"logit_bias"`` (an id
            outside the vocabulary), ``"stop"`` (stop strings without a tokenizer).
    """

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """A prompt plus ``max_tokens`` beyond an edge's context limit (``param`` ``"prompt"``), with its numbers.

    One wording at every edge (the engine, ``kvdiet.LLM``, the server, offline ``kvdiet generate``):
    ``prompt (P tokens) + max_tokens (M) = T tokens > max_model_len L; shorten the prompt or lower
    max_tokens``, every count with thousands separators (``1,024``). ``max_tokens_origin``, when given, follows
    M in its parentheses, e.g. the server's ``"the default when a completion gives none"`` for a value the
    client never sent.

    Attributes:
        prompt_tokens, max_tokens, limit: the counts (tokens); limit_name: the limit's name
            (``"max_model_len"`` or ``"max_position_embeddings"``).
    """

    def __init__(
        self,
        prompt_tokens: int,
        max_tokens: int,
        limit: int,
        limit_name: str,
        *,
        max_tokens_origin: str = "",
        at_least: bool = False,
    ) -> None:
        self.prompt_tokens, self.max_tokens = prompt_tokens, max_tokens
        self.limit, self.limit_name, self.at_least = limit, limit_name, at_least
        origin = f", {max_tokens_origin}" if max_tokens_origin else ""
        least = "at least " if at_least else ""
        total = prompt_tokens + max_tokens
        super().__init__(
            f"prompt ({least}{format_tokens(prompt_tokens)}) + max_tokens ({format_count(max_tokens)}{origin})"
            f" = {least}{format_tokens(total)} > {limit_name} {limit:,}; shorten the prompt or lower max_tokens",
            param="prompt",
        )

    def with_origin(self, max_tokens_origin: str) -> ContextLengthError:
        """The same refusal with ``max_tokens_origin`` named after the max_tokens count."""
        return ContextLengthError(
            self.prompt_tokens,
            self.max_tokens,
            self.limit,
            self.limit_name,
            max_tokens_origin=max_tokens_origin,
            at_least=self.at_least,
        )


def fit_context_length(
    prompt_tokens: int, params: SamplingParams, limit: int, limit_name: str, *, at_least: bool = False
) -> SamplingParams:
    """``params`` for a prompt of ``prompt_tokens`` within ``limit`` tokens: ``max_tokens`` None (vLLM's "as
    many as the context leaves") becomes ``limit - prompt_tokens``; an int is kept and checked.

    ``at_least``: ``prompt_tokens`` is a lower bound (a text's before it is tokenized), and a refusal says so.

    Raises:
        ContextLengthError: ``prompt_tokens + max_tokens > limit``, or with None a prompt that leaves no room
            for the one token a reply takes (an `InvalidRequestError`, ``param`` ``"prompt"``).
    """
    if params.max_tokens is None:
        if prompt_tokens >= limit:
            raise ContextLengthError(
                prompt_tokens,
                1,
                limit,
                limit_name,
                max_tokens_origin="None: the context left, at least 1",
                at_least=at_least,
            )
        return dataclasses.replace(params, max_tokens=limit - prompt_tokens)
    if prompt_tokens + params.max_tokens > limit:
        raise ContextLengthError(prompt_tokens, params.max_tokens, limit, limit_name, at_least=at_least)
    return params


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A prompt and its sampling parameters, checked together (see the module docstring for the contract).

    Made only by an edge (`LLMEngine.prepare`, `check_request`); a value built by hand carries no guarantee.

    Attributes:
        prompt_ids: the prompt's token ids (text prompts: BOS first), ``len >= 1``.
        params: the sampling parameters the prompt was checked with.
    """

    prompt_ids: tuple[int, ...]
    params: SamplingParams


def check_sampling_ids(params: SamplingParams, vocab_size: int) -> None:
    """`SamplingParams.check_vocab` at an edge: every stop and logit-bias token id in ``[0, vocab_size)``.

    Raises:
        InvalidRequestError: ``param`` ``"stop_token_ids"`` or ``"logit_bias"``, the id and the size named.
    """
    try:
        params.check_vocab(vocab_size)
    except ValueError as exc:
        raise InvalidRequestError(
            str(exc), param="stop_token_ids" if str(exc).startswith("stop") else "logit_bias"
        ) from None
