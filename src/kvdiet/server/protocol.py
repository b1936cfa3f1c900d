"""OpenAI request bodies (pydantic) and their mapping to `SamplingParams`; OpenAI-style error bodies.

Ranges follow the OpenAI API reference: ``temperature`` in [0, 2], ``top_p`` in (0, 1], ``max_tokens`` ≥ 1, ``n`` =
1 (one choice per request here), ``logit_bias`` values finite in [-100, 100]; counts are JSON integers and the other
numbers JSON numbers and switches JSON booleans, as OpenAI types them (``"16"``, ``"0.5"``, ``"true"`` and ``1`` as
a switch are refused, ``1`` is a number); null for a field OpenAI or vLLM makes nullable (``temperature``,
``top_p``, ``top_k``, ``n``, ``stream``, ``stream_options`` and its ``include_usage``, ``return_token_ids``, ``stop``,
``stop_token_ids``, ``seed``, ``logit_bias``, ``max_tokens``) is its default;
``logit_bias`` keys are token ids written as JSON writes integers (``"63"``; not ``"+63"``, ``"063"`` or ``"6_3"``).
vLLM's extensions that mean the same here are accepted: ``top_k``, ``stop_token_ids``, ``ignore_eos``,
``include_stop_str_in_output`` (the text keeps the stop string that ended it), ``return_token_ids`` (each
choice, and each streamed chunk, also carries ``token_ids``; an unstreamed response
``prompt_token_ids``; always so for completions of a model without a tokenizer, whose ``text`` is empty),
``chat_template_kwargs``. Fields kvdiet does not implement (log probabilities, penalties, ``min_tokens``, ``min_p``,
``echo``, ``suffix``, ``best_of``, ``tools``) are rejected with a 400 naming them when set to anything but their
default (``tools: []``, ``tool_choice: "none"``, ``response_format: {"type": "text"}`` and OpenAI's other no-op
spellings pass, as SDK code sends them), and so are unknown fields — never silently ignored. A chat's
``max_tokens`` (deprecated by OpenAI) and ``max_completion_tokens`` both given with different values are a 400
naming both. A chat message is checked key by key
(`kvdiet.engine.chat_messages.ChatMessage`, which `kvdiet.LLM.chat` shares); a fault's error names its path, as
every schema error's does (``messages.0.content.1.text``).
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvdiet.engine.chat_messages import ChatMessage, json_type
from kvdiet.engine.sampling import SamplingParams
from kvdiet.tokenizer import unicode_fault
from kvdiet.units import format_count

__all__ = ["ChatCompletionRequest", "CompletionRequest", "error_body"]

_UNSUPPORTED = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []),  # no tools to call: a no-op; any tool is a 400
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "repetition_penalty": (None, 1, 1.0),
    "min_tokens": (None, 0),
    "min_p": (None, 0, 0.0),
    # OpenAI's no-op spellings that SDK code sends explicitly: not storing, no metadata, no tools to call in
    # parallel, the default tier, text only
    "store": (None, False),
    "metadata": (None, {}),
    "parallel_tool_calls": (None, True, False),
    "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]),
}


def _one_of(expected: str) -> WrapValidator:
    """Validation of a union field whose failure is one sentence, ``must be {expected} (got an object)``,
    instead of pydantic's one error per union branch (``prompt.str: …; prompt.list[int]: …``). The field's
    JSON schema is unchanged."""

    def validate(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError(
                "union_type",
                "must be {expected} (got {got})",
                {"expected": expected, "got": json_type(value)},
            ) from None

    return WrapValidator(validate)


def _stop_items(value: Any) -> Any:
    """A ``stop`` list is refused for what is wrong with it, before the union's one sentence (which, for an
    item that is not a string, blamed the count: ``a list of at most 16 such strings (got an array of 1
    items)``): its first item that is not a string (``item 0 must be a string (got a number)``) or is longer
    than 1,024 characters, then more than 16 items (OpenAI's limits on ``stop``); a stop string (or item) with an
    unpaired surrogate, as the tokenizer words it for a prompt (the union blamed its length). Any other value
    passes."""
    for i, item in enumerate([value] if isinstance(value, str) else value if isinstance(value, list) else []):
        if isinstance(item, str) and (fault := unicode_fault(item)) is not None:
            where = "" if isinstance(value, str) else f"item {i}: "
            raise PydanticCustomError("stop_text", "{where}{fault}", {"where": where, "fault": fault})
    if not isinstance(value, list):
        return value
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise PydanticCustomError(
                "stop_item", "item {i} must be a string (got {got})", {"i": i, "got": json_type(item)}
            )
        if len(item) > 1024:
            raise PydanticCustomError(
                "stop_item",
                "item {i} must be at most 1,024 characters (got {got})",
                {"i": i, "got": json_type(item)},
            )
    if len(value) > 16:
        raise PydanticCustomError(
            "stop_count", "must be at most 16 stop strings (got {got})", {"got": json_type(value)}
        )
    return value


def _integer_token_ids(value: Any) -> Any:
    """A prompt list (or a one-element list of one) holding any number, with an item that is not a JSON
    integer (``1.5``, ``1.0``, ``true``, ``"1"``, ``null``, ``[2]``), is refused as such, as `LLM.generate`
    refuses it, ``token id 1.5 at index 0 is not an integer``, before the union's one sentence (which names
    no item; pydantic alone would read ``1.0``, ``true`` and ``"1"`` as 1). Any other value (text, a list
    of texts) passes unchanged."""
    ids = value[0] if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list) else value
    if isinstance(ids, list) and any(isinstance(t, int | float) for t in ids):
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool):  # JSON true/false, fractions, strings, …
                raise PydanticCustomError(
                    "token_id", "token id {t} at index {i} is not an integer", {"t": json.dumps(t), "i": i}
                )
    return value


def _drop_nulls(data: Any, names: tuple[str, ...]) -> Any:
    """A request body without the fields ``names`` sent as JSON null, so they take their defaults: OpenAI's
    nullable fields (and vLLM's) mean "the default" by null."""
    if isinstance(data, dict) and any(data.get(name, 0) is None for name in names):
        return {k: v for k, v in data.items() if not (k in names and v is None)}
    return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False

    @model_validator(mode="before")
    @classmethod
    def null_is_default(cls, data: Any) -> Any:
        """``include_usage: null`` is its default (`_drop_nulls`)."""
        return _drop_nulls(data, ("include_usage",))


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[StrictFloat, Field(ge=0, le=2, allow_inf_nan=False)] = 1.0
    top_p: Annotated[StrictFloat, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=-1)] = 0  # vLLM: -1 or 0 = all (as `SamplingParams`)
    n: Annotated[StrictInt, Field(ge=1, le=1)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[
        Annotated[str, Field(max_length=1024)]
        | Annotated[list[Annotated[str, Field(max_length=1024)]], Field(max_length=16)]
        | None,
        _one_of("a string of at most 1,024 characters or a list of at most 16 such strings"),
        BeforeValidator(_stop_items),
    ] = None
    stop_token_ids: list[StrictInt] | None = None  # "5" is not a token id (LLM.generate's rule)
    seed: Annotated[StrictInt, Field(ge=-(2**63), lt=2**64)] | None = None  # torch's seed range
    skip_special_tokens: StrictBool = True  # vLLM's extension: leave special tokens out of the text
    logit_bias: dict[str, Annotated[StrictFloat, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False  # vLLM: keep the stop string that ended the text
    return_token_ids: StrictBool = False  # vLLM's extension: each choice (and chunk) also carries token ids
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def null_is_default(cls, data: Any) -> Any:
        """Null for a nullable field with a default here is that default (`_drop_nulls`; the fields whose
        default is None take null as they are)."""
        return _drop_nulls(data, ("temperature", "top_p", "top_k", "n", "stream", "return_token_ids"))

    def unsupported(self) -> tuple[str, str] | None:
        """Why this body cannot be served as asked, and the field (the error's ``param``): a set field kvdiet
        does not implement, or fields it does not know (never silently ignored; the first by name is the
        param); None when all is well."""
        extra = dict(self.model_extra or {})
        for name, defaults in _UNSUPPORTED.items():
            value = extra.pop(name, None)
            if not any(type(value) is type(d) and value == d for d in defaults):  # 0 is not False here
                return f"{name} is not supported by kvdiet", name
        if extra:
            return f"unknown field(s): {', '.join(sorted(extra))}", min(extra)
        return None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """`SamplingParams` of this body with ``max_tokens`` resolved by the caller.

        Raises:
            ValueError: a ``logit_bias`` key that is not an integer token id, or an invalid combination.
        """
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            # an integer as JSON writes one (int() also takes "+63", " 63", "6_3", "٦٣", "063", and refuses
            # more than sys.get_int_max_str_digits() digits in its own words)
            canonical = key.isascii() and key.isdigit() and (key == "0" or key[0] != "0")
            if not canonical or len(key) > sys.get_int_max_str_digits() > 0:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            bias[int(key)] = value
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            stop_token_ids=self.stop_token_ids,  # SamplingParams reads None as none and one stop string as one
            stop=self.stop,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=bias,
            seed=self.seed,
            skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a one-element list of either."""

    prompt: Annotated[
        str | list[int] | list[str] | list[list[int]],
        _one_of("a string, a list of token ids (integers), or a one-element list of either"),
        BeforeValidator(_integer_token_ids),  # runs first (pydantic: last before/wrap validator outermost)
    ]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = 16  # the OpenAI default for completions

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request.

        Raises:
            ValueError: several prompts (one per request), or none.
        """
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
            return p
        if len(p) == 1:
            return p[0]
        if not p:
            raise ValueError("empty prompt: give at least one character or token id")
        raise ValueError(f"one prompt per request is supported, got {len(p)}")


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """`_Common.unsupported`, after a ``max_tokens`` that contradicts ``max_completion_tokens`` (OpenAI
        deprecates the first for the second; equal values pass): which to obey is not guessed."""
        both = self.max_tokens, self.max_completion_tokens
        if None not in both and both[0] != both[1]:
            return (
                f"max_tokens ({format_count(both[0])}) and max_completion_tokens ({format_count(both[1])}) differ: "
                "give one (max_tokens is deprecated in favour of max_completion_tokens)",
                "max_tokens",
            )
        return super().unsupported()


def error_body(
    message: str, *, status: int, kind: str = "invalid_request_error", param: str | None = None
) -> dict:
    """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
