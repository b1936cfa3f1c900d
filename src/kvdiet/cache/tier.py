"""`Tier`: the one protocol every cache tier sits behind (DESIGN.md §3), so the control plane
(`kvdiet.cache.control.ControlPlane`) reads and writes any of them the same way.

Implementations: the persistent tier (`kvdiet.storage.persistent.PersistentStore`), the SWA pools
(`kvdiet.storage.swa_pool.InProcessSwaPool`, `kvdiet.storage.redis_pool.RedisSwaPool`,
`kvdiet.storage.mooncake_pool.MooncakeSwaPool`), the global-KV DRAM tier
(`kvdiet.storage.mooncake_global.MooncakeGlobalPool`) — values are
payload bytes — and the simulator's `kvdiet.sim.size_tier.SizeTier`, whose values are byte sizes. What a
call mutates: ``get_many`` moves hits in the LRU order and drops expired or corrupt entries it meets;
``put_many`` writes and evicts; ``contains_prefix`` changes nothing; every call updates ``counters``.
Failures of a backend never raise: a read misses, a write returns fewer stored.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence, Sized
from typing import Protocol, TypeVar, cast

from kvdiet.cache.counters import TierCounters

__all__ = ["SwaPoolTier", "Tier", "value_bytes"]

V = TypeVar("V")


class Tier(Protocol[V]):
    """A key → value store with TTL and a byte budget.

    ``tokens`` are the block's token ids where the key names a block's entry (a tier that stores them checks
    them back on a read, guarding against a hash collision), or None where it has none to check.
    """

    counters: TierCounters

    def get_many(
        self, keys: Sequence[Hashable], tokens: Sequence[Sequence[int]] | None = None
    ) -> list[V | None]:
        """The value of each key in order, None for a miss (absent, expired, evicted, corrupt, backend down)."""
        ...

    def put_many(self, items: Sequence[tuple[Hashable, Sequence[int] | None, V]]) -> int:
        """Store each ``(key, tokens, value)``; returns how many are stored (a live entry kept counts)."""
        ...

    def contains_prefix(self, keys: Sequence[Hashable]) -> int:
        """How many leading ``keys`` are held and live (index only: nothing read, moved or counted)."""
        ...

    def close(self) -> None: ...


class SwaPoolTier(Tier[V], Protocol[V]):
    """A tier that can also drop entries by key: the SWA pool (a superseded snapshot is dropped)."""

    def discard_many(self, keys: Sequence[Hashable]) -> int:
        """Drop each key held (not counted as an eviction or expiry); returns how many were held."""
        ...


def value_bytes(value: object) -> int:
    """The size in bytes of a tier value: its length (payload bytes) or the value itself (a size)."""
    return value if isinstance(value, int) else len(cast(Sized, value))
