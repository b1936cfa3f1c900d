"""`TtlLru`: a tier of the model-free simulation as sizes only: keys with byte sizes, a fixed TTL from the
write, LRU order beyond a byte budget. Modelled on the real tiers (`kvdiet.storage.swa_pool.InProcessSwaPool`,
`kvdiet.storage.persistent.PersistentStore`, `kvdiet.cache.block_pool.BlockPool`); holds no values.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque

__all__ = ["TtlLru"]


class TtlLru:
    """Keys with byte sizes under a byte budget: fixed TTL from the write, LRU by last use.

    The semantics of `kvdiet.storage.swa_pool.InProcessSwaPool` and `kvdiet.storage.persistent.PersistentStore`
    without the bytes: ``get`` at ``now >= deadline`` is a miss that drops the entry; a hit moves it to
    the back of the LRU order without moving its deadline; ``put`` of a live key keeps it as is
    (``refresh=False``, the persistent tier) or replaces it with a new deadline (``refresh=True``, the SWA
    pool); a value larger than the budget is refused; ``capacity=None`` is unbounded, ``ttl=None`` never
    expires. Time must not go backwards between calls.
    """

    def __init__(self, capacity: int | None, ttl: float | None, *, refresh: bool) -> None:
        self.capacity, self.ttl, self.refresh = capacity, ttl, refresh
        self._items: OrderedDict[object, tuple[int, float]] = OrderedDict()  # key → (size, deadline)
        self._deadlines: deque[tuple[float, object]] = deque()  # write order = deadline order
        self.nbytes = 0
        self.kind_bytes: dict[str, int] = {}  # resident bytes by key kind (a tuple key's first item)
        self.evictions = self.expirations = self.bytes_written = self.writes = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def expire(self, now: float) -> None:
        """Drop every entry whose deadline is ≤ ``now`` (the real tiers drop them at their next read or
        sweep; dropping now only makes the resident bytes exact)."""
        dq = self._deadlines
        while dq and dq[0][0] <= now:
            deadline, key = dq.popleft()
            item = self._items.get(key)
            if item is not None and item[1] == deadline:
                self._drop(key)
                self.expirations += 1

    def get(self, key: object, now: float) -> bool:
        """Whether ``key`` is live at ``now`` (a hit refreshes its LRU position)."""
        dq = self._deadlines
        if dq and dq[0][0] <= now:
            self.expire(now)
        items = self._items
        if key in items:
            items.move_to_end(key)
            return True
        return False

    def touch(self, keys: list[object], size: int, now: float) -> None:
        """`get` each key in order, `put` it (``size`` bytes) where absent."""
        items = self._items
        for key in keys:
            if key in items:
                items.move_to_end(key)
            else:
                self.put(key, size, now)

    def put(self, key: object, size: int, now: float) -> bool:
        """Store ``key`` (``size`` bytes) at ``now``; False when refused (larger than the budget)."""
        cap = self.capacity
        if cap is not None and size > cap:
            return False
        dq = self._deadlines
        if dq and dq[0][0] <= now:
            self.expire(now)
        items = self._items
        if key in items:
            if not self.refresh:
                return True
            self._drop(key)
        if cap is not None and self.nbytes + size > cap:
            while self.nbytes + size > cap:
                self._drop(next(iter(items)))
                self.evictions += 1
        if self.ttl is None:
            items[key] = (size, math.inf)
        else:
            deadline = now + self.ttl
            items[key] = (size, deadline)
            dq.append((deadline, key))
        self.nbytes += size
        kind = key[0] if type(key) is tuple else ""
        kinds = self.kind_bytes
        kinds[kind] = kinds.get(kind, 0) + size
        self.writes += 1
        self.bytes_written += size
        return True

    def _drop(self, key: object) -> None:
        size, _ = self._items.pop(key)
        self.nbytes -= size
        self.kind_bytes[key[0] if type(key) is tuple else ""] -= size
