"""`PreparedRequest`: a request validated once, at the edge, and what the layers below it may assume.

The edges are `LLMEngine.prepare` (the engine, `kvdiet.LLM`, the server's routes) and
`kvdiet.engine.generate.check_request` (offline ``kvdiet generate``). Each checks a prompt and its sampling
parameters once, before any state changes, and either raises `InvalidRequestError` or returns a
`PreparedRequest`. Everything below the edge (the engine loop, `LLMEngine.add_prepared`, the scheduler,
`ModelRunner.start`, the model's prefill) takes such a request as checked and does not check it again:

- ``prompt_ids`` is non-empty and every id is an ``int`` in ``[0, vocab_size)`` of the model's config;
- ``len(prompt_ids) + params.max_tokens`` is at most the context limit of the edge (the engine's
  ``max_model_len``, itself at most the config's ``max_position_embeddings``; offline, the latter), so
  every later `ModelRunner.start` of the prompt plus the outputs so far (a resumption after preemption) stays
  within it too;
- every stop and logit-bias token id of ``params`` is in the vocabulary, and stop strings come only with a
  tokenizer (engine edge).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdiet.engine.sampling import SamplingParams

__all__ = ["InvalidRequestError", "PreparedRequest", "check_sampling_ids"]


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
