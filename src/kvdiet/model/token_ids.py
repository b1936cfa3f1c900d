"""Validation of the token ids a forward is given, shared by the V4.1 and V4-Flash models.

Both raise ``ValueError`` naming the bad id and its index before any state changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvdiet.config import ModelConfig

__all__ = ["check_token_ids", "check_vocab_ids", "decode_token_ids"]


class _HasLength(Protocol):
    num_tokens: int


def check_token_ids(
    cfg: ModelConfig, tokens: Sequence[int] | torch.Tensor, *, start: int = 0
) -> torch.Tensor:
    """Validate a chunk whose first token sits at position ``start``; returns int64 [T].

    Raises:
        ValueError: as `check_vocab_ids`, or the request would pass ``max_position_embeddings``.
    """
    ids = check_vocab_ids(cfg, tokens)
    end = start + ids.numel()
    if end > cfg.max_position_embeddings:
        raise ValueError(
            f"{start} cached + {ids.numel()} new tokens = {end} > "
            f"max_position_embeddings {cfg.max_position_embeddings}"
        )
    return ids


def check_vocab_ids(cfg: ModelConfig, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Validate token ids against the vocabulary alone (no position limit: a request edge checks its length
    against its context limit itself, `kvdiet.engine.prepared.fit_context_length`); returns int64 [T].

    Raises:
        ValueError: no ids, or an id that is not an integer (a float) or is outside [0, vocab_size) (named).
    """
    v = cfg.vocab_size
    try:
        ids = torch.as_tensor(tokens, device="cpu")  # validated on the host
    except (OverflowError, RuntimeError, TypeError, ValueError):
        i, t = next((i, t) for i, t in enumerate(tokens) if not (isinstance(t, int) and 0 <= t < v))
        what = "is outside the vocabulary [0, {v})" if isinstance(t, int) else "is not an integer"
        raise ValueError(f"token id {t} at index {i} {what.format(v=v)}") from None
    if ids.numel() == 0:
        raise ValueError("empty prompt: at least one token id is needed")
    if ids.is_floating_point() or ids.is_complex():  # 5.7 is no token id (an int64 cast would truncate it)
        items = list(tokens.flatten().tolist() if isinstance(tokens, torch.Tensor) else tokens)
        i = next((i for i, t in enumerate(items) if not isinstance(t, int)), 0)
        raise ValueError(f"token id {items[i]!r} at index {i} is not an integer")
    ids = ids.to(torch.int64).flatten()
    bad = ((ids < 0) | (ids >= v)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"token id {int(ids[i])} at index {i} is outside the vocabulary [0, {v})")
    return ids


def decode_token_ids(cfg: ModelConfig, states: Sequence[_HasLength], tokens: Sequence[int]) -> torch.Tensor:
    """The token ids of a decode batch, int64 [B]: ``tokens[b]`` at position ``states[b].num_tokens``.

    A batch of Python ints in range is checked at once (no tensor per request); any other (another type, an id
    out of range, a position past the limit) is checked token by token by `check_token_ids`, which raises.

    Raises:
        ValueError: an empty batch, lengths that differ, a state that appears twice, or a bad token (not one
            integer, outside the vocabulary, or past ``max_position_embeddings``), named with its request.
    """
    if len(states) != len(tokens) or not states:
        raise ValueError(
            f"decode needs one token per state, got {len(tokens)} tokens for {len(states)} states"
        )
    if len({id(s) for s in states}) != len(states):
        raise ValueError("the same request state appears twice in one decode batch")
    last = cfg.max_position_embeddings - 1  # the last position a token may take
    batch = list(tokens)
    if (
        all(type(t) is int for t in batch)  # not bool, not a tensor or numpy scalar: those go one by one
        and min(batch) >= 0
        and max(batch) < cfg.vocab_size
        and max(s.num_tokens for s in states) <= last
    ):
        return torch.tensor(batch, dtype=torch.int64, device="cpu")  # validated on the host
    ids = []
    for b, (s, t) in enumerate(zip(states, batch, strict=True)):
        try:
            ids.append(check_token_ids(cfg, [t], start=s.num_tokens))
        except ValueError as e:
            raise ValueError(f"request {b}: {e}") from None
        if ids[-1].numel() != 1:
            raise ValueError(f"request {b}: token id {t!r} is not one integer")
    return torch.cat(ids)
