"""`SizeTier`: a cache tier of the model-free simulator — the `kvdiet.cache.tier.Tier` protocol over byte sizes.

The values are sizes (ints), the rules are `kvdiet.cache.ttl_lru.TtlLru`'s (the same object the in-process
SWA pool keeps its bytes in), and time is the simulator's trace time (a `ManualClock` it advances). Keys are
`kvdiet.cache.keys.TupleKeys` tuples, so resident bytes are counted by `KeyKind`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvdiet.cache.counters import TierCounters
from kvdiet.cache.ttl_lru import TtlLru
from kvdiet.storage.clock import ManualClock

__all__ = ["SizeTier"]


def _kind(key: Hashable) -> Hashable:
    return key[0] if type(key) is tuple else ""


class SizeTier:
    """Keys with byte sizes under a byte budget, on trace time.

    Args:
        capacity: budget in bytes (None: unbounded).
        ttl: seconds from the write (None: forever).
        refresh: a put of a live key restarts it (the SWA pool) or keeps it (the persistent tier).
        clock: trace time, advanced by the simulator.
    """

    def __init__(self, capacity: int | None, ttl: float | None, *, refresh: bool, clock: ManualClock) -> None:
        self.counters = TierCounters()
        self.entries: TtlLru[int] = TtlLru(capacity, ttl, refresh=refresh, counters=self.counters, kind=_kind)
        self.clock = clock

    @property
    def capacity(self) -> int | None:
        return self.entries.capacity

    @property
    def nbytes(self) -> int:
        return self.entries.nbytes

    def __len__(self) -> int:
        return len(self.entries)

    def get_many(
        self, keys: Sequence[Hashable], tokens: Sequence[Sequence[int]] | None = None
    ) -> list[int | None]:
        now = self.clock.now()
        return [self.entries.get(k, now) for k in keys]

    def put_many(self, items: Sequence[tuple[Hashable, Sequence[int] | None, int]]) -> int:
        now = self.clock.now()
        return sum(self.entries.put(k, size, size, now) for k, _, size in items)

    def contains_prefix(self, keys: Sequence[Hashable]) -> int:
        self.entries.expire(self.clock.now())
        return next((i for i, k in enumerate(keys) if k not in self.entries), len(keys))

    def touch(self, keys: list[Hashable], size: int) -> None:
        """Make ``keys`` the most recently used, in order, putting absent ones (the device pool's LRU)."""
        self.entries.touch(keys, size, size, self.clock.now())

    def expire(self) -> None:
        """Drop what has expired by now (so resident bytes are exact at a sample)."""
        self.entries.expire(self.clock.now())

    def close(self) -> None:
        self.entries.clear()
