"""The chat message checks `kvdiet.LLM.chat` shares with the server: Python values are named as Python's."""

from __future__ import annotations

import pytest

from kvdiet.engine.chat_messages import check_conversation
from kvdiet.engine.prepared import InvalidRequestError


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (("hi",), "messages.0.content: must be a string or a list of content parts (objects) (got a tuple)"),
        ([("text", "hi")], "messages.0.content.0: must be a content part (an object), got a tuple"),
        (7, "(got a number)"),
    ],
)
def test_a_python_value_json_has_no_type_for_is_named_by_its_class(content, said) -> None:
    """From `LLM.chat`, a tuple was "a number" (the JSON types' fallback)."""
    with pytest.raises(InvalidRequestError) as info:
        check_conversation([{"role": "user", "content": content}])
    assert said in str(info.value) and info.value.param == "messages"


def test_a_message_object_is_taken_as_its_model_dump_and_anything_else_is_named_in_user_terms() -> None:
    """The OpenAI SDK's messages are pydantic models (a reply's ``ChatCompletionMessage``): `LLM.chat` takes one
    as its ``model_dump()``, the dict the server gets over JSON; a value that is neither was refused naming
    kvdiet's internal class ("instance of ChatMessage")."""
    from openai.types.chat import ChatCompletionMessage, ParsedChatCompletionMessage

    reply = ChatCompletionMessage(role="assistant", content="Hello.")
    got = check_conversation([{"role": "user", "content": "hi"}, reply, {"role": "user", "content": "again"}])
    assert got == check_conversation(
        [{"role": "user", "content": "hi"}, reply.model_dump(), {"role": "user", "content": "again"}]
    )
    assert got[1]["role"] == "assistant" and got[1]["content"] == [
        {"type": "text", "text": "Hello.", "prompt_cache_breakpoint": None}
    ]
    parsed = ParsedChatCompletionMessage(role="assistant", content="Hello.")  # the SDK's stream/parse helpers
    assert check_conversation([parsed, {"role": "user", "content": "again"}])[0] == got[1]
    refused = ChatCompletionMessage(role="assistant", content="x", refusal="no")
    with pytest.raises(InvalidRequestError, match=r"^messages\.0\.refusal: refusals are not supported"):
        check_conversation([refused])
    for value, kind in ((5, "a number"), ("hi", "a string of 2 characters"), (("user", "hi"), "a tuple")):
        with pytest.raises(InvalidRequestError) as info:
            check_conversation([{"role": "user", "content": "hi"}, value])
        said = str(info.value)
        assert said == (
            "messages.1: must be a message: an object with role and content (from Python a dict, or an object "
            f"whose model_dump() gives one, as the OpenAI SDK's messages do), got {kind}"
        ), said


def test_text_that_is_not_valid_unicode_is_named_at_its_own_path_and_character() -> None:
    """An unpaired surrogate was found in the rendered conversation: the error gave its offset in the chat
    template's text (character 29 for the first character of the first message) and no path."""
    cases = [
        ([{"role": "user", "content": "\udfff"}], "messages.0.content: ", "U+DFFF at character 0"),
        (
            [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": "abc\ud800"}],
                },
            ],
            "messages.1.content.1.text: ",
            "U+D800 at character 3",
        ),
    ]
    for messages, path, where in cases:
        with pytest.raises(InvalidRequestError) as info:
            check_conversation(messages)
        assert str(info.value) == f"{path}the text is not valid Unicode: unpaired surrogate {where}"
        assert info.value.param == "messages"
    assert check_conversation([{"role": "user", "content": "h\u00e9llo \U0001f600"}])[0]["content"][0][
        "text"
    ] == ("h\u00e9llo \U0001f600")
