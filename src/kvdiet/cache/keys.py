"""Tier keys: what a key names beside the block hash (or trace id) it derives from.

One vocabulary for the engine and the simulator. Each executor gives the control plane a `KeyScheme` that
turns ``(block, kind)`` into the key its tiers store: the engine's `HashKeys` derives 32-byte keys from the
chained block hash (``blake2b(hash, person=b"kvdiet-" + kind + tag)``; a block's global KV is keyed by the
hash itself); the simulator's `IdKeys` uses the trace id for a block's global KV and ``(kind, trace id)``
tuples for the rest, which also let a size-only tier count resident bytes by class.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Hashable, Sequence
from itertools import repeat
from typing import Protocol

__all__ = ["HashKeys", "IdKeys", "KeyKind", "KeyScheme"]


class KeyKind(enum.StrEnum):
    """What a tier key names (the values are the ``person`` strings of `HashKeys`)."""

    BLOCK = "kv"
    """A block's global KV."""
    SNAPSHOT = "snap"
    """A window snapshot in the persistent tier (boundary-snapshot, checkpoint:K)."""
    POOL_SNAPSHOT = "swa"
    """A window snapshot in the SWA pool (bounded-replay)."""
    WINDOW_BLOCK = "win"
    """A block's window entries (full-store)."""


class KeyScheme(Protocol):
    """Turns a block's identity (chained hash or trace id) and a `KeyKind` into a tier key."""

    def key(self, block: Hashable, kind: KeyKind) -> Hashable: ...

    def keys(self, blocks: Sequence[Hashable], kind: KeyKind) -> Sequence[Hashable]:
        """`key` of each block, in order."""
        ...


class HashKeys:
    """The engine's keys: 32-byte ``blake2b`` digests of the chained block hash.

    Args:
        window_tag: appended to the person string of window snapshots (``b"-r"`` when taken with
            decoder-side replay, whose decoder windows are approximate: an exact run never restores one).
    """

    def __init__(self, window_tag: bytes = b"") -> None:
        self.window_tag = window_tag

    def key(self, block: bytes, kind: KeyKind) -> bytes:
        if kind is KeyKind.BLOCK:
            return block
        tag = self.window_tag if kind in (KeyKind.SNAPSHOT, KeyKind.POOL_SNAPSHOT) else b""
        return hashlib.blake2b(block, digest_size=32, person=b"kvdiet-" + kind.encode() + tag).digest()

    def keys(self, blocks: Sequence[bytes], kind: KeyKind) -> list[bytes]:
        return list(blocks) if kind is KeyKind.BLOCK else [self.key(b, kind) for b in blocks]


class IdKeys:
    """The simulator's keys: a block's global KV under its trace id itself (an int, as `HashKeys` keys it by
    the hash), every other kind under a ``(kind, id)`` tuple — so a size-only tier tells a block's global KV
    from window state by the key's type alone (`kvdiet.sim.size_tier`), and the run of block keys a
    write-through stores is the ids as they are."""

    def key(self, block: Hashable, kind: KeyKind) -> Hashable:
        return block if kind is KeyKind.BLOCK else (kind, block)

    def keys(self, blocks: Sequence[Hashable], kind: KeyKind) -> Sequence[Hashable]:
        return blocks if kind is KeyKind.BLOCK else list(zip(repeat(kind), blocks))
