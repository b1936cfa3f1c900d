"""The SWA pool: short-lived window snapshots in host DRAM, keyed by the prefix hash at a block boundary.

V4.1 keeps window (SWA) state out of the persistent tier; a snapshot lives only here, for minutes
(seed 001: 10% of each machine's DRAM, TTL of minutes). Values are opaque bytes (a serialized
`kvdiet.storage.snapshot` with its own header and checksum), so any backend that stores bytes with a TTL
fits the `SwaPool` protocol: `InProcessSwaPool` here (the default: this process's memory, gone with it) and
`kvdiet.storage.redis_pool.RedisSwaPool` (Redis servers shared by every process and machine that lists
them). `kvdiet.storage.swa_pool_factory.create_swa_pool` picks one from a ``--swa-pool`` value.

Semantics shared by every backend: a value put at ``t0`` is served while ``now < t0 + ttl`` (fixed TTL;
reads refresh LRU order, never the deadline); least recently used entries go first when the byte budget
is full; a value larger than the whole budget is refused.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Protocol

from kvdiet.cache.counters import TierCounters
from kvdiet.storage.clock import Clock, SystemClock
from kvdiet.units import format_bytes

__all__ = [
    "DEFAULT_SWA_POOL_TTL_S",
    "IN_PROCESS",
    "InProcessSwaPool",
    "SwaPool",
    "default_swa_pool_bytes",
]

DEFAULT_SWA_POOL_TTL_S = 300.0
"""5 minutes: the pool's TTL "of minutes" (DESIGN.md §1, seed 001)."""

IN_PROCESS = "in-process"
"""The ``--swa-pool`` value of the default backend, `InProcessSwaPool`."""


def default_swa_pool_bytes() -> int:
    """10% of this machine's physical RAM in bytes (DESIGN.md §1: 10% of each machine's DRAM)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 10


class SwaPool(Protocol):
    """What the cache manager needs from an SWA-pool backend."""

    counters: TierCounters

    def open(self) -> None:
        """Connect (a remote backend); never raises on I/O: an unreachable backend only makes misses."""
        ...

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
        self._deadlines: deque[tuple[float, bytes]] = deque()  # put order = deadline order (fixed TTL)
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

    def open(self) -> None:
        """Nothing to connect."""

    def put(self, key: bytes, value: bytes) -> bool:
        size = len(value)
        if size > self.capacity_bytes:
            return False
        with self._lock:
            now = self.clock.now()
            self._drop(key)
            if self._nbytes + size > self.capacity_bytes:
                self._expire(now)  # expired values go before any live one is evicted
            while self._nbytes + size > self.capacity_bytes:
                self._drop(next(iter(self._items)))
                self.counters.evictions += 1
            self._items[key] = (bytes(value), now + self.ttl_s)
            self._deadlines.append((now + self.ttl_s, key))
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
            return self._expire(self.clock.now())

    def _expire(self, now: float) -> int:
        """Drop values whose deadline is ≤ ``now`` (oldest deadlines first); lock held."""
        dead = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, key = self._deadlines.popleft()
            item = self._items.get(key)
            if item is not None and item[1] == deadline:  # not rewritten since
                self._drop(key)
                dead += 1
        self.counters.expirations += dead
        return dead

    def close(self) -> None:
        with self._lock:
            self._items.clear()
            self._deadlines.clear()
            self._nbytes = 0

    def _drop(self, key: bytes) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self._nbytes -= len(item[0])
