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
