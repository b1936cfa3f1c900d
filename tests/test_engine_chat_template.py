"""The DeepSeek chat template: exact strings, and the special tokens encode to their single ids."""

from __future__ import annotations

import pytest

from kvdiet.engine.chat_template import chat_thinking, render_chat
from kvdiet.engine.prepared import InvalidRequestError
from kvdiet.tokenizer import Tokenizer


def test_conversation_renders_in_deepseeks_format() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": [{"type": "text", "text": "1+"}, {"type": "text", "text": "1=?"}]},
    ]
    assert render_chat(messages) == (
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>hello<｜Assistant｜></think>Hi!<｜end▁of▁sentence｜>"
        "<｜User｜>1+1=?<｜Assistant｜></think>"
    )
    assert (
        render_chat(messages[1:2], thinking=True)
        == "<｜begin▁of▁sentence｜><｜User｜>hello<｜Assistant｜><think>"
    )


def test_special_tokens_encode_to_single_ids() -> None:
    tok = Tokenizer.deepseek()
    ids = tok.encode(render_chat([{"role": "user", "content": "hi"}]))
    assert ids[0] == tok.bos_token_id
    assert ids[1] == tok._tok.token_to_id("<｜User｜>") and ids[-2] == tok._tok.token_to_id("<｜Assistant｜>")
    assert ids[-1] == tok._tok.token_to_id("</think>")
    assert tok.decode(ids) == render_chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "at least one message"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "last message"),
        ([{"role": "tool", "content": "a"}], "role 'tool'"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "only text parts"),
        ([{"role": "user", "content": 5}], "string or a list"),
    ],
)
def test_bad_conversations_are_rejected(messages, message) -> None:
    with pytest.raises(ValueError, match=message):
        render_chat(messages)


def test_chat_template_kwargs_take_only_a_mapping_with_a_boolean_thinking() -> None:
    """From `LLM.chat` any Python value comes: one that is no mapping is the same one-line refusal (``"yes"``
    was dict()'s 'dictionary update sequence' ValueError, ``True`` a TypeError, a list of pairs taken)."""
    assert chat_thinking(None) is False and chat_thinking({}) is False
    assert chat_thinking({"thinking": True}) is True
    for bad in ("yes", True, 1, [("thinking", True)], {"thinking": "yes"}, {"thinking": True, "x": 1}):
        with pytest.raises(InvalidRequestError, match="chat_template_kwargs takes only 'thinking'") as info:
            chat_thinking(bad)
        assert info.value.param == "chat_template_kwargs"
