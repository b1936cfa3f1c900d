"""Token-id checks of a decode batch (`decode_token_ids`): one check for a batch of Python ints, the per-token
check (`check_token_ids`) for anything else, with the same ids and the same errors."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvdiet.config import load_config
from kvdiet.model.token_ids import check_token_ids, decode_token_ids

CFG = load_config("v4.1-micro")


@dataclass
class _State:
    num_tokens: int


def _one_by_one(states: list[_State], tokens: list[object]) -> torch.Tensor:
    return torch.cat(
        [check_token_ids(CFG, [t], start=s.num_tokens) for s, t in zip(states, tokens, strict=True)]
    )


@pytest.mark.parametrize(
    "tokens",
    [[0, 5, CFG.vocab_size - 1], [True, 7, 2], [torch.tensor(3), 4, 5]],
    ids=["ints", "a-bool", "a-tensor"],
)
def test_a_batch_gives_the_ids_the_per_token_check_gives(tokens: list[object]) -> None:
    states = [_State(0), _State(17), _State(CFG.max_position_embeddings - 1)]
    got = decode_token_ids(CFG, states, tokens)
    assert got.dtype == torch.int64 and got.shape == (3,)
    assert torch.equal(got, _one_by_one(states, tokens)) and got.tolist() == [int(t) for t in tokens]


@pytest.mark.parametrize(
    ("tokens", "at", "needle"),
    [
        ([1, CFG.vocab_size], 0, f"token id {CFG.vocab_size} at index 0 is outside the vocabulary"),
        ([-1, 2], 0, "token id -1 at index 0"),
        ([1, 2**70], 0, f"token id {2**70} at index 0"),
        ([1, 2], CFG.max_position_embeddings, f"> max_position_embeddings {CFG.max_position_embeddings}"),
    ],
)
def test_a_bad_token_or_position_raises_the_per_token_error(tokens: list[int], at: int, needle: str) -> None:
    with pytest.raises(ValueError) as err:
        decode_token_ids(CFG, [_State(3), _State(at)], tokens)
    assert needle in str(err.value)


def test_a_batch_must_be_one_token_per_distinct_state() -> None:
    state = _State(0)
    with pytest.raises(ValueError, match="one token per state, got 1 tokens for 2 states"):
        decode_token_ids(CFG, [state, _State(0)], [1])
    with pytest.raises(ValueError, match="appears twice"):
        decode_token_ids(CFG, [state, state], [1, 2])


@pytest.mark.parametrize(
    ("tokens", "needle"),
    [
        ([1, [5, 6]], "request 1: token id [5, 6] is not one integer"),
        ([1, 5.7], "request 1: token id 5.7 at index 0 is not an integer"),
        ([torch.tensor(2.0), 1], "request 0: token id tensor(2.) at index 0 is not an integer"),
        ([torch.tensor([2, 3]), 1], "request 0: token id tensor([2, 3]) at index 0 is not an integer"),
        ([1, CFG.vocab_size], f"request 1: token id {CFG.vocab_size} at index 0 is outside"),
    ],
)
def test_a_token_that_is_not_one_integer_names_its_request(tokens: list[object], needle: str) -> None:
    with pytest.raises(ValueError) as err:
        decode_token_ids(CFG, [_State(3), _State(4)], tokens)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    ("tokens", "needle"),
    [
        ([1, 2.5, 3], "token id 2.5 at index 1 is not an integer"),
        ([1.0, 2], "token id 1.0 at index 0 is not an integer"),  # an integral float is still no token id
        (torch.tensor([4.0, 5.0]), "token id 4.0 at index 0 is not an integer"),
    ],
)
def test_a_prompt_with_a_float_is_refused_not_truncated(tokens: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        check_token_ids(CFG, tokens)
