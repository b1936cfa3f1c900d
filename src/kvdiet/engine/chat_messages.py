"""OpenAI chat messages, checked key by key (pydantic): `ChatMessage` and its content parts (`TextPart`), and
`check_conversation`, the same check for `kvdiet.LLM.chat` that the server's ``/v1/chat/completions`` body
runs on its ``messages``. Knows nothing of the template (`kvdiet.engine.chat_template`) or of HTTP.

A message is a known ``role``, a ``content`` (required: a string or a non-empty list of text parts), an
optional ``name``, and OpenAI's assistant keys for features kvdiet lacks taken only empty; a text part may
carry the OpenAI SDK's ``prompt_cache_breakpoint`` (`PromptCacheBreakpoint`). A fault names its path
(``messages.0.content.1.text``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    StrictStr,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvdiet.engine.prepared import InvalidRequestError
from kvdiet.tokenizer import unicode_fault

__all__ = ["ChatMessage", "PromptCacheBreakpoint", "TextPart", "check_conversation", "json_type"]

_ROLES = ("system", "developer", "user", "assistant")


def json_type(value: object) -> str:
    """The JSON type of a parsed value, with its article (for error messages); a Python value JSON has no
    type for (`kvdiet.LLM.chat` takes Python's) is named by its class (``a tuple``)."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return f"a string of {len(value):,} characters"
    if isinstance(value, list):
        return f"an array of {len(value):,} items"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, dict):
        return "an object"
    return "a number" if isinstance(value, int | float) else f"a {type(value).__name__}"


class PromptCacheBreakpoint(BaseModel):
    """A content part's ``prompt_cache_breakpoint`` (the OpenAI SDK's ``PromptCacheBreakpoint`` on text, image
    and file parts, ``openai`` 3.57): ``mode`` ``"explicit"`` and an optional ``ttl`` ``"30m"`` or ``"12h"``,
    marking the end of a reusable prompt prefix. Taken and not needed: the prefix cache keeps every prompt's
    whole blocks, found by hash, so a prompt gets the same text and reply with or without it; its TTLs are
    the server's (``--persistent-ttl``, ...). Values other than OpenAI's are refused at their path."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] | None = None


def _valid_unicode(text: str) -> str:
    """``text`` where it is valid Unicode, else an error at its own path (``messages.0.content``,
    ``messages.0.content.1.text``) naming the character in it (`kvdiet.tokenizer.unicode_fault`): found in the
    rendered conversation, it was placed in the chat template's text."""
    fault = unicode_fault(text)
    if fault is not None:
        raise PydanticCustomError("unicode", "{fault}", {"fault": fault})
    return text


class TextPart(BaseModel):
    """A content part: ``{"type": "text", "text": ...}``, the only kind the chat template takes, with the OpenAI
    SDK's optional ``prompt_cache_breakpoint`` (null: none, as a part the SDK returns dumps it)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: Annotated[StrictStr, AfterValidator(_valid_unicode)]
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None

    @model_validator(mode="before")
    @classmethod
    def text_only(cls, data: Any) -> Any:
        """Anything but an object with ``type`` "text" is one error at the part itself (not one per key)."""
        if not isinstance(data, dict):
            raise PydanticCustomError(
                "content_part", "must be a content part (an object), got {got}", {"got": json_type(data)}
            )
        if data.get("type") != "text":
            raise PydanticCustomError(
                "content_part",
                "only text parts are supported (got type {got})",
                {"got": json.dumps(data.get("type"))},
            )
        return data


def _content_parts(value: Any) -> Any:
    """Message content as its parts: a string is one text part; a list is validated part by part (so an
    error names its path, ``messages.0.content.1.text``); an empty list is refused, as OpenAI's API refuses
    it (its schema's ``minItems: 1``; a string, even empty, is the way to send no text); anything else, null
    included, is refused whole."""
    if isinstance(value, str):
        return [{"type": "text", "text": _valid_unicode(value)}]
    if isinstance(value, list) and value:
        return value
    if isinstance(value, list):
        raise PydanticCustomError(
            "empty_array", "must not be an empty array: give a string or at least one content part", {}
        )
    raise PydanticCustomError(
        "union_type",
        "must be a string or a list of content parts (objects) (got {got})",
        {"got": json_type(value)},
    )


def _known_role(role: str) -> str:
    if role not in _ROLES:
        raise PydanticCustomError(
            "role", "role {role} is not supported ({roles})", {"role": repr(role), "roles": ", ".join(_ROLES)}
        )
    return role


def _empty(value: Any) -> bool:
    """Whether an unimplemented assistant key's value is one kvdiet takes: null or an empty list."""
    return value is None or (isinstance(value, list) and not value)


def _empty_only(what: str) -> BeforeValidator:
    """A key of OpenAI's assistant message that kvdiet does not implement: null or an empty list is taken (a
    client that sends a reply's message back, as the OpenAI SDK's ``message.model_dump()`` gives it, sends
    ``"refusal": null``, ``"tool_calls": null``), anything else is refused at the key's path."""

    def check(value: Any) -> None:
        if _empty(value):
            return None
        raise PydanticCustomError(
            "unsupported", "{what} are not supported by kvdiet (only null or [] is taken)", {"what": what}
        )

    return BeforeValidator(check)


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """A model's JSON schema with its ``$defs`` written in place of their ``$ref``s, so it can stand inside
    another document (the server's OpenAPI schema, where ``#/$defs/...`` would point nowhere)."""
    defs = schema.get("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return walk(defs[node["$ref"].rsplit("/", 1)[1]])
            return {k: walk(v) for k, v in node.items() if k != "$defs"}
        return [walk(v) for v in node] if isinstance(node, list) else node

    return walk(schema)


_PART_SCHEMA = _inlined(TextPart.model_json_schema())


class ChatMessage(BaseModel):
    """One message, as OpenAI's chat API takes it: ``role``, ``content`` (required: a string or a non-empty list
    of text parts; OpenAI lets an assistant message give it null or omit it only beside ``tool_calls``, which kvdiet
    does not take: such a message is refused for its ``tool_calls``) and the optional participant ``name``
    (accepted; DeepSeek's template has no place for it). The keys of OpenAI's assistant message for features
    kvdiet lacks (``refusal``, ``tool_calls``, ``function_call``, ``audio``, ``annotations``) and the OpenAI
    SDK's ``parsed`` (its stream and parse helpers' replies) are taken only as null or [], so a reply's message
    can be sent back; any other value, and any other key, is refused, named by its path
    (``messages.0.tool_calls``, ``messages.0.foo``)."""

    model_config = ConfigDict(extra="forbid")

    role: Annotated[StrictStr, AfterValidator(_known_role)]
    # OpenAI's assistant-message keys for features kvdiet does not have, taken only empty (a reply sent back);
    # the tool keys are validated before content, so their refusal is the error's first (its param)
    tool_calls: Annotated[None, _empty_only("tool calls")] = None
    function_call: Annotated[None, _empty_only("function calls")] = None
    content: Annotated[
        list[TextPart],
        BeforeValidator(_content_parts),
        WithJsonSchema(
            {"anyOf": [{"type": "string"}, {"type": "array", "items": _PART_SCHEMA, "minItems": 1}]}
        ),
    ]
    name: StrictStr | None = None
    refusal: Annotated[None, _empty_only("refusals")] = None
    audio: Annotated[None, _empty_only("audio replies")] = None
    annotations: Annotated[None, _empty_only("annotations")] = None
    # the OpenAI SDK's own key on a reply from its ``chat.completions.stream`` / ``parse`` helpers
    # (`ParsedChatCompletionMessage`), sent back with the message: null without a response_format
    parsed: Annotated[None, _empty_only("parsed structured outputs")] = None

    @model_validator(mode="before")
    @classmethod
    def as_message(cls, data: Any) -> Any:
        """A message is a dict, or an object whose ``model_dump()`` gives one (the OpenAI SDK's messages, such
        as a reply's ``ChatCompletionMessage``: the dict the server gets over JSON); anything else is one error
        at the message. A message with a non-empty ``tool_calls`` or ``function_call`` is refused for that key
        alone: OpenAI lets such a message give ``content`` null or leave it out, so its content is not the
        fault (the empty content put in its place is never used: the tool key's refusal fails the message)."""
        dump = getattr(data, "model_dump", None)
        data = dump() if not isinstance(data, dict) and callable(dump) else data
        if not isinstance(data, dict):
            raise PydanticCustomError(
                "message",
                "must be a message: an object with role and content (from Python a dict, or an object whose "
                "model_dump() gives one, as the OpenAI SDK's messages do), got {got}",
                {"got": json_type(data)},
            )
        tools = ("tool_calls", "function_call")
        if data.get("content") is None and not all(_empty(data.get(k)) for k in tools):
            return data | {"content": ""}
        return data


_CONVERSATION = TypeAdapter(list[ChatMessage])


def check_conversation(messages: object) -> list[dict[str, Any]]:
    """``messages`` (one conversation: a list of message dicts, or objects with ``model_dump()``) checked as
    `ChatMessage` checks each message of a ``/v1/chat/completions`` body, as plain dicts for
    `kvdiet.engine.chat_template.render_chat` (content as its list of text parts).

    Raises:
        InvalidRequestError (a ValueError, ``param`` ``"messages"``): every fault as the server words it,
            ``messages.0.content: must be ...`` (its path, the message's index first), joined by ``; ``.
    """
    try:
        return [m.model_dump() for m in _CONVERSATION.validate_python(messages)]
    except ValidationError as exc:
        said = "; ".join(f"{'.'.join(['messages', *map(str, e['loc'])])}: {e['msg']}" for e in exc.errors())
        raise InvalidRequestError(said, param="messages") from None
