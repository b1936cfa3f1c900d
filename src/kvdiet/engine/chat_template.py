"""The chat template: OpenAI-style messages → one DeepSeek-V4.1 prompt string.

DeepSeek's conversation format (the V3.1 / V3.2 / V4 family; the ``tokenizer.json`` holds its special
tokens, and DeepSeek's ``encoding_dsv32.py`` renders it the same way):

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜><｜User｜>{user}<｜Assistant｜></think>

- system (and ``developer``) messages go right after BOS, in order, concatenated;
- each user turn is ``<｜User｜>`` + its text; each past assistant turn is ``<｜Assistant｜></think>`` + its
  text + ``<｜end▁of▁sentence｜>`` (past reasoning is dropped, as DeepSeek's template does);
- the prompt ends with ``<｜Assistant｜>`` and ``</think>`` (non-thinking mode, the default) or ``<think>``
  (``chat_template_kwargs: {"thinking": true}``).

Content is a string or a list of ``{"type": "text", "text": ...}`` parts. The last message must be a user
message. The special-token strings are encoded as their single ids by the tokenizer (`chat_prompt_ids`).
The server's ``/v1/chat/completions`` and `kvdiet.LLM.chat` both render with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvdiet.engine.prepared import ContextLengthError, InvalidRequestError
from kvdiet.tokenizer import TooManyTokensError

if TYPE_CHECKING:
    from kvdiet.tokenizer import Tokenizer

__all__ = ["chat_prompt_ids", "chat_thinking", "render_chat"]

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"


def render_chat(messages: Sequence[Mapping[str, Any]], *, thinking: bool = False) -> str:
    """The prompt string for ``messages`` (see the module docstring).

    Raises:
        ValueError: no messages, an unknown role, non-text content, or a last message that is not the user's.
    """
    if not messages:
        raise ValueError("messages must contain at least one message")
    system, turns = [], []
    for i, msg in enumerate(messages):
        role, text = msg.get("role"), _text(msg.get("content"), i)
        if role in ("system", "developer"):
            system.append(text)
        elif role == "user":
            turns.append(USER + text)
        elif role == "assistant":
            turns.append(ASSISTANT + END_THINK + text + EOS)
        else:
            raise ValueError(
                f"messages[{i}].role {role!r} is not supported (system, developer, user, assistant)"
            )
    if messages[-1].get("role") != "user":
        raise ValueError("the last message must be a user message")
    return BOS + "".join(system) + "".join(turns) + ASSISTANT + (THINK if thinking else END_THINK)


def chat_thinking(chat_template_kwargs: Mapping[str, Any] | None) -> bool:
    """Whether the prompt opens thinking: ``chat_template_kwargs`` takes only ``thinking`` (a bool; None or
    left out: False, DeepSeek's non-thinking mode).

    Raises:
        InvalidRequestError (``param`` ``"chat_template_kwargs"``): not a mapping (from `kvdiet.LLM.chat`:
            ``"yes"``, ``True``, a list of pairs), another key, or a ``thinking`` not a bool.
    """
    if chat_template_kwargs is None:
        return False
    kwargs = dict(chat_template_kwargs) if isinstance(chat_template_kwargs, Mapping) else None
    thinking = kwargs.pop("thinking", False) if kwargs is not None else None
    if not isinstance(thinking, bool) or kwargs:
        raise InvalidRequestError(
            "chat_template_kwargs takes only 'thinking' (true or false)", param="chat_template_kwargs"
        )
    return thinking


def chat_prompt_ids(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    thinking: bool,
    fit: tuple[int, int, str] | None = None,
) -> list[int]:
    """The prompt's token ids: `render_chat`, encoded (BOS is in the text, so none is added).

    ``fit``: ``(max_model_len, reply tokens, their origin)``: a rendered text whose `Tokenizer.least_tokens`
    plus the reply's tokens cannot fit is refused before it is encoded (megabytes take seconds and gigabytes).

    Raises:
        InvalidRequestError (``param`` ``"messages"``): as `render_chat`, or text the tokenizer refuses (an
            unpaired surrogate); with ``fit``, a `ContextLengthError` whose prompt count is a lower bound
            (``at_least``; its ``param`` stays ``"prompt"``: the caller names the field).
    """
    try:
        text = render_chat(messages, thinking=thinking)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="messages") from None
    if fit is not None and (least := tokenizer.least_tokens(text, enough=fit[0])) and least + fit[1] > fit[0]:
        raise ContextLengthError(
            least, fit[1], fit[0], "max_model_len", max_tokens_origin=fit[2], at_least=True
        )
    try:
        return tokenizer.encode(text, most=None if fit is None else max(0, fit[0] - fit[1]))
    except TooManyTokensError as exc:  # (fit given) stopped with text left: a lower bound, as least_tokens'
        raise ContextLengthError(
            exc.at_least, fit[1], fit[0], "max_model_len", max_tokens_origin=fit[2], at_least=True
        ) from None
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="messages") from None


def _text(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ValueError(f"messages[{i}].content: only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
