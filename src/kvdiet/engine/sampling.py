"""Sampling parameters (validated up front) and next-token sampling from logits."""

from __future__ import annotations

import operator
import sys
from collections.abc import Iterable, Mapping
from dataclasses import InitVar, dataclass, field
from numbers import Integral, Real

import torch

from kvdiet.engine.vllm_args import check_vllm_only
from kvdiet.tokenizer import unicode_fault

__all__ = ["GREEDY_BELOW", "SamplingParams", "sample", "sampling_generator"]

GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily (vLLM's ``_SAMPLING_EPS``)."""

_VLLM_ONLY = {  # vLLM's `SamplingParams` arguments kvdiet does not implement → the values that change nothing
    "n": (1,),
    "best_of": (None, 1),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "min_p": (0,),
    "min_tokens": (0,),
    "logprobs": (None,),
    "prompt_logprobs": (None,),
}


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick output tokens.

    Attributes:
        max_tokens: tokens to generate at most (≥ 0; 0 = score the prompt only; None = as many as the context
            leaves, vLLM's None: the edge that checks the prompt, `LLMEngine.prepare` or `check_request`, sets it
            to the context limit minus the prompt's tokens).
        temperature: 0 = greedy (argmax, lowest id on ties; so is anything below `GREEDY_BELOW`); > 0 divides
            the logits. The default is 0, unlike vLLM's ``SamplingParams`` (1.0), so that ``kvdiet.LLM`` and
            ``kvdiet generate`` runs are reproducible without a seed; the HTTP server keeps OpenAI's 1.0.
        top_k: keep the k most likely tokens; 0 or -1 = all (vLLM's convention: -1 is stored as 0).
        top_p: keep the smallest set whose probability reaches p (1.0 = all).
        stop_token_ids: generation ends after emitting one of these (the token is kept in the output).
        stop: generation ends when the output text contains one of these strings; the text is cut before
            it (needs a tokenizer and ``detokenize``).
        include_stop_str_in_output: keep the stop string that ended the output in its text (vLLM's; default
            False: cut before it). The text ends where the first stop string to be complete ends (the earliest
            end, however the text splits into tokens); text a token brought past it is dropped, as vLLM drops it.
        detokenize: give the output as text (vLLM's; default True). False: ``text`` stays empty and the
            output is its token ids only (no stop strings then: they are looked for in the text).
        ignore_eos: keep generating after the tokenizer's EOS token (it is a stop token otherwise).
        skip_special_tokens: leave special tokens (BOS, EOS, placeholders, chat markers) out of the output
            text (vLLM's default); the token ids keep them.
        logit_bias: token id → value added to its logit before sampling (OpenAI ``logit_bias``, -100…100).
        seed: seed of the per-request sampling generator (None: a fresh random seed per request in the
            engine, 0 in `generate`).

    vLLM's arguments that kvdiet does not implement are taken only at the values that change nothing, so code
    written for vLLM that spells its defaults out runs unchanged: ``n=1``, ``best_of`` None or 1,
    ``presence_penalty=0``, ``frequency_penalty=0``, ``repetition_penalty=1``, ``min_p=0``, ``min_tokens=0``,
    ``logprobs=None``, ``prompt_logprobs=None`` (init-only: not stored, not in the repr). Any other vLLM
    argument is Python's own unexpected-keyword TypeError.
    Raises:
        TypeError: ``max_tokens`` (or None) or ``top_k`` (or a ``seed``) not an int (`numbers.Integral`:
            numpy's ints too), ``temperature`` or ``top_p`` not a real number (`numbers.Real`); bools refused
            as both; ``ignore_eos``, ``skip_special_tokens``, ``include_stop_str_in_output`` or ``detokenize``
            not a bool; a ``stop`` item not a string, a stop
            token id or logit-bias key not an int, a bias not a number; named. One ``stop`` string is one stop
            string; ``None`` for ``stop``, ``stop_token_ids`` or ``logit_bias`` is none.
        TypeError: one of vLLM's arguments above at another value (``n=2``, ``presence_penalty=0.5``), named
            with the words "not supported by kvdiet" (a TypeError, as the unknown keyword it was before; a bool
            is never a default here).
        ValueError: any value out of range (named), or ``stop`` strings with ``detokenize=False``; checked at
            construction — before any state changes.
    """

    max_tokens: int | None = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    n: InitVar[int] = 1
    best_of: InitVar[int | None] = None
    presence_penalty: InitVar[float] = 0.0
    frequency_penalty: InitVar[float] = 0.0
    repetition_penalty: InitVar[float] = 1.0
    min_p: InitVar[float] = 0.0
    min_tokens: InitVar[int] = 0
    logprobs: InitVar[int | None] = None
    prompt_logprobs: InitVar[int | None] = None

    def __post_init__(self, *vllm_only: object) -> None:
        check_vllm_only("SamplingParams", _VLLM_ONLY, dict(zip(_VLLM_ONLY, vllm_only, strict=True)))
        # ints as `operator.index` takes them (numpy's too), numbers as `numbers.Real`; bools are neither here.
        # Kept as Python's int and float (the same values) from here on.
        for name, kinds, what in (
            ("max_tokens", Integral, "an int or None"),
            ("top_k", Integral, "an int"),
            ("temperature", Real, "a number"),
            ("top_p", Real, "a number"),
        ):
            value = getattr(self, name)
            if name == "max_tokens" and value is None:
                continue
            if not isinstance(value, kinds) or isinstance(value, bool):
                raise TypeError(f"{name} must be {what}, got {value!r}")
            if type(value) not in (int, float):
                object.__setattr__(self, name, operator.index(value) if kinds is Integral else float(value))
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize"):
            if not isinstance(getattr(self, name), bool):  # "no" would be truthy
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self._normalize_collections()
        if self.seed is not None:
            if not isinstance(self.seed, Integral) or isinstance(self.seed, bool):
                raise TypeError(f"seed must be an int or None, got {self.seed!r}")
            object.__setattr__(self, "seed", operator.index(self.seed))
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        # also refuses NaN, and an int past a float's range (the sampler's division would raise OverflowError)
        if not 0 <= self.temperature <= sys.float_info.max:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= 1, or 0 or -1 for all tokens, got {self.top_k}")
        if self.top_k == -1:  # vLLM's "disabled": one value for it from here on
            object.__setattr__(self, "top_k", 0)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.stop and not self.detokenize:  # vLLM refuses it in the same words
            raise ValueError(
                "stop strings are only supported when detokenize is True. Set detokenize=True to use stop."
            )
        for t, b in self.logit_bias.items():
            if not -100.0 <= b <= 100.0:  # also rejects NaN
                raise ValueError(f"logit_bias of token {t} must be in [-100, 100], got {b}")

    def _normalize_collections(self) -> None:
        """``stop`` as a tuple of strings (one string is one stop string, as in vLLM), ``stop_token_ids`` as a
        tuple of Python ints, ``logit_bias`` as a dict of Python int → float (None for any of them: none, vLLM's
        default).

        Raises:
            TypeError: a stop that is not a string or an iterable of strings (bytes refused), stop token ids
                not an iterable of ints, a stop token id or logit-bias key that is not an int
                (`numbers.Integral`; bools refused), a bias that is not a number, or a logit_bias that is not a
                mapping; named.
            ValueError: an int bias past float's range (so outside [-100, 100]), named as the range check does; a
                stop string with an unpaired surrogate.
        """
        if self.stop is not None and (isinstance(self.stop, bytes) or not isinstance(self.stop, Iterable)):
            raise TypeError(f"stop must be a string or a sequence of strings, got {self.stop!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else () if self.stop is None else tuple(self.stop)
        for i, s in enumerate(stop):
            if not isinstance(s, str):
                raise TypeError(f"stop must be a string or a sequence of strings, got an item {s!r}")
            if (fault := unicode_fault(s)) is not None:  # never generated text: refused as HTTP refuses it
                raise ValueError(f"stop string {i}: {fault}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, Iterable):
            raise TypeError(f"stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}")
        ids = self.stop_token_ids
        # an array (numpy or torch) by its values as Python scalars; its truth is no test of emptiness
        ids = () if ids is None else tuple(ids.tolist() if getattr(ids, "ndim", 0) >= 1 else ids)
        for t in ids:
            if not isinstance(t, Integral) or isinstance(t, bool):
                raise TypeError(f"stop_token_ids must be ints, got {t!r}")
        bias = {} if self.logit_bias is None else self.logit_bias
        if not isinstance(bias, Mapping):
            raise TypeError(f"logit_bias must be a mapping of token id to bias, got {bias!r}")
        for t, b in bias.items():
            if not isinstance(t, Integral) or isinstance(t, bool):
                raise TypeError(f"logit_bias keys must be token ids (ints), got {t!r}")
            if not isinstance(b, Real) or isinstance(b, bool):
                raise TypeError(f"logit_bias of token {t} must be a number, got {b!r}")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(operator.index(t) for t in ids))
        try:
            floats = {operator.index(t): float(b) for t, b in bias.items()}
        except OverflowError:  # an int past float's range, so past [-100, 100] too: the range check's words
            t, b = next((t, b) for t, b in bias.items() if not -100 <= b <= 100)
            raise ValueError(f"logit_bias of token {t} must be in [-100, 100], got {b}") from None
        object.__setattr__(self, "logit_bias", floats)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ``ValueError`` naming a stop or logit-bias token id outside ``[0, vocab_size)`` (case B27)."""
        for what, ids in (("stop token id", self.stop_token_ids), ("logit_bias token id", self.logit_bias)):
            for t in ids:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"{what} {t} is outside the vocabulary [0, {vocab_size})")


def sampling_generator(seed: int) -> torch.Generator:
    """A CPU generator for a request's ``seed`` in [-2**63, 2**64), its state from all 64 bits.

    torch's CPU generator seeds its Mersenne Twister from the seed's low 32 bits alone, so seeds 1 and 2**32 + 1
    (and -1 and 2**32 - 1) drew the same tokens. The seed, read mod 2**64, keeps its low 32 bits where the high
    ones are 0 (every seed in [0, 2**32) draws as it did); else the high 32 bits, mixed (times 0x9E3779B1, then
    MurmurHash3's 32-bit finalizer steps: a bijection, 0 only at 0), are XORed into them, so seeds that differ
    only in their high bits draw differently. Raises ValueError for a seed outside the range."""
    if not -(2**63) <= seed < 2**64:
        raise ValueError(f"seed must be in [-2**63, 2**64), got {seed}")
    mask = 0xFFFFFFFF
    wrapped = seed % 2**64
    low, high = wrapped & mask, wrapped >> 32
    mixed = (high * 0x9E3779B1) & mask
    mixed ^= mixed >> 16
    mixed = (mixed * 0x85EBCA6B) & mask
    mixed ^= mixed >> 13
    return torch.Generator().manual_seed(low ^ mixed)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """Pick one token id from fp32 ``logits`` [V] under ``params``. A temperature below `GREEDY_BELOW` is
    greedy (dividing by it would overflow fp32 to inf and NaN)."""
    if params.logit_bias:
        logits = logits.clone()
        for t, b in params.logit_bias.items():
            logits[t] += b
    if params.temperature < GREEDY_BELOW:
        return int(torch.argmax(logits))
    scaled = (logits.float() - logits.max()) / params.temperature
    if params.top_k:
        kth = torch.topk(scaled, min(params.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cut = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
        cut[0] = False  # the most likely token always stays (a top_p below fp32's range, 5e-324, is 0 here)
        sorted_probs[cut] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
