"""`TtlLru`: the TTL and LRU rules of a byte-budget tier, once, for every tier that keeps them in memory.

The SWA pool in this process (`kvdiet.storage.swa_pool.InProcessSwaPool`: values are snapshot bytes) and
every tier of the model-free simulator (`kvdiet.sim.size_tier.SizeTier`: values are byte sizes) are this
class; the persistent tier keeps the same rules in its SQLite index (`kvdiet.storage.persistent`, held to
this class by ``tests/test_sim_model_free.py``). Pure data: no clock (callers pass ``now``), no lock.

Rules:
- fixed TTL counted from the write: an entry put at ``t0`` is live while ``now < t0 + ttl``; reads never
  move the deadline (case B23); entries past it are dropped (and counted) at the next call;
- LRU by last use beyond the byte budget: a hit moves the entry to the back; a put that does not fit
  evicts from the front (expired entries go first, so a live one is never evicted for a dead one);
- a put of a live key replaces it with a new deadline (``refresh=True``: the SWA pool) or keeps it as it
  is (``refresh=False``: the persistent tier, whose TTL a rewrite does not extend);
- a value larger than the whole budget is refused; ``capacity=None`` is unbounded, ``ttl=None`` never
  expires.
Time must not go backwards between calls. Kept exactly, event by event: the peak of the bytes held
(``peak``, what each kind held then ``peak_kinds``, each kind's own peak ``kind_peak``), the bytes written
(``counters.bytes_written``, by kind ``kind_written``) and the bytes held integrated over time
(``byte_seconds``, by kind ``kind_byte_seconds``; an entry counts until its deadline, not until the call that
finds it expired).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from itertools import compress, repeat, takewhile
from operator import eq, is_, not_
from typing import Generic, TypeVar, cast

from kvdiet.cache.counters import TierCounters

__all__ = ["TtlLru"]

V = TypeVar("V")


class TtlLru(Generic[V]):
    """Values with byte sizes under a byte budget: fixed TTL from the write, LRU by last use.

    Args:
        capacity: budget in bytes (None: unbounded).
        ttl: seconds an entry stays live (None: forever).
        refresh: whether a put of a live key replaces it (new value, new deadline).
        counters: where lookups, hits, bytes read and written, evictions and expirations are counted.
        kind: maps a key to the class its bytes are counted under in ``kind_bytes`` (default: none kept).
    """

    def __init__(
        self,
        capacity: int | None,
        ttl: float | None,
        *,
        refresh: bool,
        counters: TierCounters | None = None,
        kind: Callable[[Hashable], Hashable] | None = None,
    ) -> None:
        self.capacity, self.ttl, self.refresh = capacity, ttl, refresh
        self.counters = counters if counters is not None else TierCounters()
        self.kind = kind
        self.nbytes = 0
        self.kind_bytes: dict[Hashable, int] = {}
        self.peak = 0  # the largest ``nbytes`` ever held, exact (checked at every put)
        self.peak_kinds: dict[Hashable, int] = {}  # ``kind_bytes`` at that moment
        self.kind_peak: dict[Hashable, int] = {}
        self.kind_written: dict[Hashable, int] = {}
        self.byte_seconds = 0.0  # ∫ nbytes dt from the first call to the last (expiries at their deadlines)
        self.kind_byte_seconds: dict[Hashable, float] = {}
        self._since: float | None = None  # the time ``byte_seconds`` runs to
        # key → value, size, deadline; least recently used first where a budget needs that order to evict
        # by, else (unbounded: nothing is ever evicted) a plain dict in write order, cheaper to write
        self._items: dict[Hashable, tuple[V, int, float]] = OrderedDict() if capacity is not None else {}
        # (deadline, keys written together), in write order = deadline order
        self._deadlines: deque[tuple[float, Sequence[Hashable]]] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        """Whether ``key`` is held (live at the last call; no LRU move, nothing counted)."""
        return key in self._items

    def written_at(self, key: Hashable) -> float | None:
        """When the entry held under ``key`` was written (seconds; None: not held or no TTL)."""
        item = self._items.get(key)
        return None if item is None or self.ttl is None else item[2] - self.ttl

    def values(self) -> list[tuple[V, int]]:
        """``(value, size)`` of every entry held, least recently used first (unbounded: in write order)."""
        return [(v, n) for v, n, _ in self._items.values()]

    def expire(self, now: float) -> int:
        """Drop every entry whose deadline is ≤ ``now`` (its bytes counted in ``byte_seconds`` up to the
        deadline); returns how many (also counted)."""
        dq, dead, items = self._deadlines, 0, self._items
        if not dq or dq[0][0] > now:  # nothing due (most calls): only the byte-seconds run on
            since = self._since
            if since is None:
                self._since = now
            elif now > since:
                self._accrue(now)
            return 0
        while dq and dq[0][0] <= now:
            deadline, keys = dq.popleft()
            self._accrue(deadline)
            for key in keys:
                item = items.get(key)
                if item is not None and item[2] == deadline:  # not rewritten since
                    self._drop(key)
                    dead += 1
        self._accrue(now)
        self.counters.expirations += dead
        return dead

    def _accrue(self, until: float) -> None:
        """Add the bytes held since the last call to ``byte_seconds`` (and by kind), up to ``until``."""
        since = self._since
        if since is None or until <= since:
            if since is None:
                self._since = until
            return
        dt = until - since
        self.byte_seconds += self.nbytes * dt
        seconds = self.kind_byte_seconds
        for k, n in self.kind_bytes.items():
            seconds[k] = seconds.get(k, 0.0) + n * dt
        self._since = until

    def get(self, key: Hashable, now: float) -> V | None:
        """The value if ``key`` is live at ``now`` (a hit moves it to the back of the LRU order)."""
        self.expire(now)
        c = self.counters
        c.lookups += 1
        item = self._items.get(key)
        if item is None:
            return None
        if self.capacity is not None:
            cast("OrderedDict[Hashable, tuple[V, int, float]]", self._items).move_to_end(key)
        c.hits += 1
        c.bytes_read += item[1]
        return item[0]

    def get_many(self, keys: Sequence[Hashable], now: float) -> list[V | None]:
        """`get` of each key at ``now`` (one expiry pass)."""
        self.expire(now)
        c, items, lru = self.counters, self._items, self.capacity is not None
        out: list[V | None] = []
        c.lookups += len(keys)
        for key in keys:
            item = items.get(key)
            if item is None:
                out.append(None)
                continue
            if lru:
                cast("OrderedDict[Hashable, tuple[V, int, float]]", items).move_to_end(key)
            c.hits += 1
            c.bytes_read += item[1]
            out.append(item[0])
        return out

    def held_prefix(self, keys: Sequence[Hashable], now: float) -> int:
        """How many leading ``keys`` are live at ``now`` (no LRU move, nothing counted)."""
        self.expire(now)
        return sum(1 for _ in takewhile(self._items.__contains__, keys))

    def put(self, key: Hashable, value: V, size: int, now: float) -> bool:
        """Store ``value`` (``size`` bytes) under ``key`` at ``now``; False when refused (larger than the
        budget). A live key is replaced (``refresh``) or kept as it is (True, nothing written)."""
        self.expire(now)
        return self._put(key, value, size, now)

    def _put(self, key: Hashable, value: V, size: int, now: float) -> bool:
        """`put` with expiry done at ``now``."""
        cap = self.capacity
        if cap is not None and size > cap:
            return False
        items = self._items
        if key in items:
            if not self.refresh:
                return True
            self._drop(key)
        if cap is not None:
            while self.nbytes + size > cap:
                self._drop(next(iter(items)))
                self.counters.evictions += 1
        self._put_new((key,), (value,), (size,), size, now)
        return True

    def put_many(
        self, keys: Sequence[Hashable], values: Sequence[V], sizes: Sequence[int], now: float
    ) -> int:
        """`put` each ``keys[i]`` with ``values[i]`` of ``sizes[i]`` bytes at ``now`` (one expiry pass); returns
        how many were stored.

        Distinct keys whose new ones fit without an eviction (a run of blocks written through) are stored at
        once: the same entries, order, counts and peaks as one `put` after another (with nothing evicted,
        bytes only grow during the batch, so every peak is reached at its end; a live key is kept as it is
        unless ``refresh``)."""
        self.expire(now)
        if not keys:
            return 0
        cap, items = self.capacity, self._items
        batch: tuple[Sequence[Hashable], Sequence[V], Sequence[int]] | None
        if items.keys().isdisjoint(keys):  # a run of new blocks written through, most often
            batch = (keys, values, sizes)
        elif self.refresh or (cap is not None and max(sizes) > cap):
            batch = None  # each put replaces a live key (or one is refused): one after another
        else:  # live keys are kept as they are: only the others are written
            keep = list(map(not_, map(items.__contains__, keys)))
            batch = (list(compress(keys, keep)), list(compress(values, keep)), list(compress(sizes, keep)))
        if batch is not None:
            total = sum(batch[2])
            if (cap is None or self.nbytes + total <= cap) and (
                not batch[0] or self._put_new(batch[0], batch[1], batch[2], total, now)
            ):
                return len(keys)
        put = self._put
        return sum(put(key, value, size, now) for key, value, size in zip(keys, values, sizes, strict=True))

    def _put_new(
        self, keys: Sequence[Hashable], values: Sequence[V], sizes: Sequence[int], total: int, now: float
    ) -> bool:
        """Store keys none of which is held, known to fit the budget; False, with nothing stored, when a key
        repeats among them (then each is put one after another)."""
        deadline = math.inf if self.ttl is None else now + self.ttl
        items, n = self._items, len(keys)
        if n == 1:  # a snapshot, or a request's one new block
            items[keys[0]] = (values[0], total, deadline)
        else:
            before = len(items)
            if sizes.count(sizes[0]) == n and (
                values is sizes or all(map(is_, values, repeat(values[0])))
            ):  # one value for the whole run (the simulator's block sizes): one shared, immutable entry
                items.update(zip(keys, repeat((values[0], sizes[0], deadline))))
            elif values is sizes:  # values are the sizes (the simulator's): one shared entry per size
                shared = {size: (cast(V, size), size, deadline) for size in set(sizes)}
                items.update(zip(keys, map(shared.__getitem__, sizes), strict=True))
            else:
                items.update(zip(keys, zip(values, sizes, repeat(deadline)), strict=True))
            if len(items) - before != n:  # a key repeats: undone (none was held before)
                for key in keys:
                    items.pop(key, None)
                return False
        if self.ttl is not None:
            self._deadlines.append((deadline, keys if type(keys) is tuple else tuple(keys)))
        self.nbytes += total
        kind = self.kind
        if kind is not None:
            if n == 1:
                self._count_kind(kind(keys[0]), total)
            else:
                self._add_kinds(kind, keys, sizes, total)
        if self.nbytes > self.peak:
            self.peak = self.nbytes
            if self.kind is not None:
                self.peak_kinds = dict(self.kind_bytes)
        c = self.counters
        c.entries_written += n
        c.bytes_written += total
        return True

    def _add_kinds(
        self, kind: Callable[[Hashable], Hashable], keys: Sequence[Hashable], sizes: Sequence[int], total: int
    ) -> None:
        """Count ``total`` new bytes (``sizes`` under ``keys``) by ``kind``: held, peak, written."""
        of = list(map(kind, keys))
        if of.count(of[0]) == len(of):  # one kind, most often
            self._count_kind(of[0], total)
        else:  # each kind's bytes, kinds in order of first appearance (C-level passes, no loop per key)
            for k in dict.fromkeys(of):
                self._count_kind(k, sum(compress(sizes, map(eq, of, repeat(k)))))

    def _count_kind(self, kind: Hashable, n: int) -> None:
        """Count ``n`` new bytes of ``kind``: held, peak, written."""
        held = self.kind_bytes
        after = held[kind] = held.get(kind, 0) + n
        peak = self.kind_peak
        peak[kind] = max(peak.get(kind, 0), after)
        self.kind_written[kind] = self.kind_written.get(kind, 0) + n

    def discard(self, key: Hashable, now: float) -> bool:
        """Drop ``key`` if held (not counted as an eviction or expiry); whether it was."""
        self.expire(now)
        if key not in self._items:
            return False
        self._drop(key)
        return True

    def clear(self) -> None:
        """Forget every entry (counters stay)."""
        self._items.clear()
        self._deadlines.clear()
        self.kind_bytes.clear()
        self.nbytes = 0

    def _drop(self, key: Hashable) -> None:
        _, size, _ = self._items.pop(key)
        self.nbytes -= size
        if self.kind is not None:
            self.kind_bytes[self.kind(key)] -= size
