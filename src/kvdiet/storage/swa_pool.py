"""The SWA pool: short-lived window snapshots in host DRAM, keyed by the prefix hash at a block boundary.

V4.1 keeps window (SWA) state out of the persistent tier; a snapshot lives only here, for minutes
(seed 001: 10% of each machine's DRAM, TTL of minutes). Values are opaque bytes (a serialized
`kvdiet.storage.snapshot` with its own header and checksum), so any backend that stores bytes with a TTL
fits the `SwaPool` protocol; the Redis backend of a later issue is another file behind it.

Semantics shared by every backend: a value put at ``t0`` is served while ``now < t0 + ttl`` (fixed TTL;
reads refresh LRU order, never the deadline); least recently used entries go first when the byte budget
is full; a value larger than the whole budget is refused.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from kvdiet.cache.counters import TierCounters
from kvdiet.storage.clock import Clock, SystemClock
from kvdiet.units import format_bytes

__all__ = ["DEFAULT_SWA_POOL_TTL_S", "InProcessSwaPool", "SwaPool", "default_swa_pool_bytes"]

DEFAULT_SWA_POOL_TTL_S = 300.0
"""5 minutes: the pool's TTL "of minutes" (DESIGN.md §1, seed 001)."""


def default_swa_pool_bytes() -> int:
    """10% of this machine's physical RAM in bytes (DESIGN.md §1: 10% of each machine's DRAM)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 10


class SwaPool(Protocol):
    """What the cache manager needs from an SWA-pool backend."""

    counters: TierCounters

    def put(self, key: bytes, value: bytes) -> bool:
        """Store ``value`` under ``key`` with the pool's TTL; False when refused or the backend failed."""
        ...

    def get(self, key: bytes) -> bytes | None:
        """The value, or None (absent, expired, evicted, backend down)."""
        ...

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """`get` for several keys under the same rules."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes of values held now (for metrics; a shared backend reports what it can see)."""
        ...

    def __len__(self) -> int:
        """Entries held now."""
        ...

    def close(self) -> None: ...


class InProcessSwaPool:
    """An LRU byte budget with a fixed TTL, in this process's memory. Thread-safe.

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
        self._items: OrderedDict[bytes, tuple[bytes, float]] = OrderedDict()  # key → (value, deadline)
        self._nbytes = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"in-process SWA pool ({format_bytes(self.capacity_bytes)}, TTL {self.ttl_s:g} s)"

    @property
    def nbytes(self) -> int:
        """Bytes of values held (including expired ones not yet swept)."""
        return self._nbytes

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: bytes, value: bytes) -> bool:
        size = len(value)
        if size > self.capacity_bytes:
            return False
        with self._lock:
            self._drop(key)
            while self._nbytes + size > self.capacity_bytes:
                self._drop(next(iter(self._items)))
                self.counters.evictions += 1
            self._items[key] = (bytes(value), self.clock.now() + self.ttl_s)
            self._nbytes += size
            self.counters.entries_written += 1
            self.counters.bytes_written += size
        return True

    def get(self, key: bytes) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            now = self.clock.now()
            for key in keys:
                self.counters.lookups += 1
                item = self._items.get(key)
                if item is not None and now >= item[1]:
                    self._drop(key)
                    self.counters.expirations += 1
                    item = None
                if item is None:
                    out.append(None)
                    continue
                self._items.move_to_end(key)
                self.counters.hits += 1
                self.counters.bytes_read += len(item[0])
                out.append(item[0])
        return out

    def sweep(self) -> int:
        """Drop every expired value; returns how many."""
        with self._lock:
            now = self.clock.now()
            dead = [k for k, (_, deadline) in self._items.items() if now >= deadline]
            for key in dead:
                self._drop(key)
            self.counters.expirations += len(dead)
            return len(dead)

    def close(self) -> None:
        with self._lock:
            self._items.clear()
            self._nbytes = 0

    def _drop(self, key: bytes) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self._nbytes -= len(item[0])
