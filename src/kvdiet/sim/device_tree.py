"""`DeviceTree`: the simulator's device pool as a tree of chained blocks with LRU eviction of leaves, in time
proportional to the blocks a request adds, not to its prompt's length.

The engine's `kvdiet.cache.block_pool.BlockPool` frees a request's blocks last block first, so a prefix's head
always outlives its tail, and a lookup takes a prefix from its root: the blocks held form a tree (a block's
parent is the block before it in its chain) whose least recently used leaf is what the pool evicts next. This
class keeps exactly that order without moving every block of a prompt on every request:

- a request's use of blocks ``[0, end)`` stamps only the last one (its ancestors' time is the newest of their
  descendants', applied when a child is evicted and the parent becomes a leaf);
- a lookup is a binary search over the request's chained ids (an id present implies its ancestors are):
  O(log n) dictionary reads;
- eviction pops the oldest leaf from a heap (stale heap entries are skipped): O(log n) per block evicted.

Ids name whole prefixes (chained, as trace hash ids are), so a block's parent is fixed when it is added.
Sizes are bytes per block (`kvdiet.cache.control.Geometry.payload_bytes`); the budget is in bytes.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Sequence

from kvdiet.cache.counters import TierCounters

__all__ = ["DeviceTree"]

_ROOT = object()


class DeviceTree:
    """Blocks under a byte budget, evicted least recently used leaf first.

    Args:
        capacity: budget in bytes.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.counters = TierCounters()
        self.nbytes = 0
        self._parent: dict[Hashable, Hashable] = {}
        self._children: dict[Hashable, int] = {}
        self._size: dict[Hashable, int] = {}
        self._stamp: dict[Hashable, tuple[float, int]] = {}  # (time, order): ties broken by use order
        self._leaves: list[tuple[tuple[float, int], Hashable]] = []  # heap; stale entries skipped
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._size)

    def __contains__(self, block: Hashable) -> bool:
        return block in self._size

    def match(self, ids: Sequence[Hashable], limit: int) -> int:
        """How many leading ``ids[:limit]`` are held (binary search: a held id's ancestors are held)."""
        lo, hi = 0, limit  # ids[:lo] held; ids[hi:] not known held
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ids[mid - 1] in self._size:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def use(self, ids: Sequence[Hashable], end: int, size_of: Callable[[int], int], now: float) -> None:
        """Blocks ``ids[:end]`` are in use at ``now``: those not held are added (block i is ``size_of(i)``
        bytes; leaves are evicted to fit) and the last one becomes the most recently used, its ancestors with
        it. Cost: a binary search, then the blocks added."""
        if end <= 0:
            return
        first = self.match(ids, end)
        parent = ids[first - 1] if first > 0 else _ROOT
        for i in range(first, end):
            if not self._add(ids[i], parent, size_of(i)):
                end = i  # larger than the whole budget: the chain stops here
                break
            parent = ids[i]
        if end > 0:
            self._stamp_leaf(ids[end - 1], now)

    def _add(self, block: Hashable, parent: Hashable, size: int) -> bool:
        if size > self.capacity:
            return False
        while self.nbytes + size > self.capacity:
            if not self._evict(parent):  # the parent must stay while its child is added
                return False
        self._parent[block] = parent
        self._children[block] = 0
        self._size[block] = size
        if parent is not _ROOT:
            self._children[parent] += 1
        self.nbytes += size
        self.counters.entries_written += 1
        self.counters.bytes_written += size
        return True

    def _stamp_leaf(self, block: Hashable, now: float) -> None:
        stamp = (now, next(self._order))
        self._stamp[block] = stamp
        if self._children[block] == 0:
            heapq.heappush(self._leaves, (stamp, block))

    def _evict(self, protect: Hashable) -> bool:
        """Drop the least recently used leaf other than ``protect``; False when there is none."""
        held, skipped = self._leaves, []
        while held:
            stamp, block = heapq.heappop(held)
            if block not in self._size or self._children[block] or self._stamp.get(block) != stamp:
                continue  # stale: gone, no longer a leaf, or used again since
            if block == protect:
                skipped.append((stamp, block))
                continue
            for item in skipped:
                heapq.heappush(held, item)
            self._drop(block, stamp)
            return True
        for item in skipped:
            heapq.heappush(held, item)
        return False

    def _drop(self, block: Hashable, stamp: tuple[float, int]) -> None:
        parent = self._parent.pop(block)
        self.nbytes -= self._size.pop(block)
        del self._children[block], self._stamp[block]
        self.counters.evictions += 1
        if parent is not _ROOT:
            self._children[parent] -= 1
            # the parent was used whenever its child was: it is at least as recent
            self._stamp[parent] = max(self._stamp.get(parent, stamp), stamp)
            if self._children[parent] == 0:
                heapq.heappush(self._leaves, (self._stamp[parent], parent))
