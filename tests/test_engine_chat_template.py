"""The DeepSeek chat template: exact strings, and the special tokens encode to their single ids."""

from __future__ import annotations

import pytest

from kvdiet.engine.chat_template import render_chat
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
