"""The SWA pool: short-lived window snapshots in host DRAM, keyed by the prefix hash at a block boundary.

V4.1 keeps window (SWA) state out of the persistent tier; a snapshot lives only here, for minutes
(seed 001: 10% of each machine's DRAM, TTL of minutes). Values are opaque bytes (a serialized
`kvdiet.model.snapshot` with its own header and checksum), so any backend that stores bytes with a TTL
fits the `SwaPool` protocol: `InProcessSwaPool` here (the default: this process's memory, gone with it),
`kvdiet.storage.redis_pool.RedisSwaPool` (Redis servers shared by every process and machine that lists
them) and `kvdiet.storage.mooncake_pool.MooncakeSwaPool` (a Mooncake Store cluster).
`kvdiet.storage.swa_pool_factory.create_swa_pool` picks one from a ``--swa-pool`` value.

Semantics shared by every backend: a value put at ``t0`` is served while ``now < t0 + ttl`` (fixed TTL;
reads refresh LRU order, never the deadline); least recently used entries go first when the byte budget
is full; a value larger than the whole budget is refused.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Protocol

from kvdiet.cache.counters import TierCounters
from kvdiet.cache.options import DEFAULT_SWA_POOL_TTL_S, IN_PROCESS
from kvdiet.cache.tier import Tier
from kvdiet.cache.ttl_lru import TtlLru
from kvdiet.storage.clock import Clock, SystemClock
from kvdiet.units import format_bytes

__all__ = [
    "DEFAULT_SWA_POOL_TTL_S",
    "IN_PROCESS",
    "InProcessSwaPool",
    "SwaPool",
    "SwaPoolBase",
    "default_swa_pool_bytes",
]


def default_swa_pool_bytes() -> int:
    """10% of this machine's physical RAM in bytes (DESIGN.md §1: 10% of each machine's DRAM)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 10


class SwaPool(Tier[bytes], Protocol):
    """What the control plane needs from an SWA-pool backend: the `kvdiet.cache.tier.Tier` calls plus
    ``open``, single-key ``put``/``get`` and what it holds."""

    def open(self) -> None:
        """Connect (a remote backend); never raises on I/O: an unreachable backend only makes misses."""
        ...

    def put(self, key: bytes, value: bytes) -> bool:
        """Store ``value`` under ``key`` with the pool's TTL; False when refused or the backend failed."""
        ...

    def get(self, key: bytes) -> bytes | None:
        """The value, or None (absent, expired, evicted, backend down)."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes of values held now (for metrics; a shared backend reports what it can see)."""
        ...

    def __len__(self) -> int:
        """Entries held now."""
        ...


class SwaPoolBase:
    """What every SWA-pool backend derives from its ``put`` and ``get_many``: ``get`` and ``put_many``."""

    def get(self, key: bytes) -> bytes | None:
        """The value stored under ``key``, or None (`get_many` of one key)."""
        return self.get_many([key])[0]

    def put_many(self, items: Sequence[tuple[bytes, Sequence[int] | None, bytes]]) -> int:
        """`put` each ``(key, tokens, value)`` (``tokens`` unused: snapshot keys name whole prefixes); returns
        how many were stored."""
        return sum(self.put(key, value) for key, _, value in items)


class InProcessSwaPool(SwaPoolBase):
    """An LRU byte budget with a fixed TTL, in this process's memory (`kvdiet.cache.ttl_lru.TtlLru` under a
    lock, on a clock). Thread-safe.

    Args:
        capacity_bytes: budget in bytes (default `default_swa_pool_bytes`).
        ttl_s: seconds a snapshot stays servable (default 300).
        clock: time source (`SystemClock` by default; a `ManualClock` in tests).
    Raises:
        ValueError: capacity or TTL not positive.
    """

    def __init__(
        self,
        capacity_bytes: int | None = None,
        *,
        ttl_s: float = DEFAULT_SWA_POOL_TTL_S,
        clock: Clock | None = None,
    ) -> None:
        capacity = default_swa_pool_bytes() if capacity_bytes is None else capacity_bytes
        if capacity <= 0 or ttl_s <= 0:
            raise ValueError(f"SWA pool needs capacity > 0 and ttl > 0, got {capacity} B and {ttl_s} s")
        self.capacity_bytes, self.ttl_s = capacity, float(ttl_s)
        self.clock = clock or SystemClock()
        self.counters = TierCounters()
        self._entries: TtlLru[bytes] = TtlLru(capacity, self.ttl_s, refresh=True, counters=self.counters)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"in-process SWA pool ({format_bytes(self.capacity_bytes)}, TTL {self.ttl_s:g} s)"

    @property
    def nbytes(self) -> int:
        """Bytes of values held (expired ones leave at the next call)."""
        return self._entries.nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def open(self) -> None:
        """Nothing to connect."""

    def put(self, key: bytes, value: bytes) -> bool:
        with self._lock:
            return self._entries.put(key, bytes(value), len(value), self.clock.now())

    def get_many(
        self, keys: Sequence[bytes], tokens: Sequence[Sequence[int]] | None = None
    ) -> list[bytes | None]:
        with self._lock:
            return self._entries.get_many(keys, self.clock.now())

    def discard_many(self, keys: Sequence[bytes]) -> int:
        """Drop each held key (a superseded snapshot); returns how many were held."""
        with self._lock:
            now = self.clock.now()
            return sum(self._entries.discard(k, now) for k in keys)

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are held and live (no LRU move, nothing counted)."""
        with self._lock:
            self._entries.expire(self.clock.now())
            return next((i for i, k in enumerate(keys) if k not in self._entries), len(keys))

    def sweep(self) -> int:
        """Drop every expired value; returns how many."""
        with self._lock:
            return self._entries.expire(self.clock.now())

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
