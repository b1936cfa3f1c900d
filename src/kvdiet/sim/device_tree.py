"""`DeviceTree`: the simulator's device pool as a radix tree of chained blocks with LRU eviction of leaves, in
time proportional to the blocks a request adds or loses, not to its prompt's length.

The engine's `kvdiet.cache.block_pool.BlockPool` frees a request's blocks last block first, so a prefix's head
always outlives its tail, and a lookup takes a prefix from its root: the blocks held form a tree (a block's
parent is the block before it in its chain) whose least recently used leaf is what the pool evicts next.
This class keeps exactly that order, one block at a time in effect, while storing runs:

- a *node* is a run of blocks with no branch inside it (a branch splits the node where it leaves); its
  children hang off its last block;
- a request's use of blocks ``[0, end)`` stamps only the last one (a *mark*: the count of uses so far, so
  uses are ordered as they are made); a block's time is the newest mark at or below it in the tree, which
  is the time it takes on when everything after it is evicted;
- a lookup is a binary search over the request's chained ids (an id present implies its ancestors are);
- eviction pops the least recently used leaf node from a heap and drops blocks from its tail until enough
  bytes are free, a mark makes the new tail newer (the node goes back on the heap), or the protected block
  is reached; an emptied node hands its time to its parent. A leaf has one heap entry: a use moves only
  its time, and an entry popped with an older time than its node's goes back in at the newer one (times
  are unique, so leaves leave the heap in the order of a heap updated at every use).

Ids name whole prefixes (chained, as trace hash ids are), so a block's parent is fixed when it is added, and
a block's position in its chain is known from the request that names it. Sizes are bytes per block
(`kvdiet.cache.control.Geometry.payloads`); the budget is in bytes.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Hashable, Sequence

from kvdiet.cache.counters import TierCounters

__all__ = ["DeviceTree"]

Stamp = int
"""When a block was last used: uses are numbered in the order they are made (trace time never goes back)."""
_NEVER: Stamp = -1  # a block no request ended at (yet)
_SEQ_BITS = 40  # a leaf-heap entry's number takes the low bits of its key (fewer than 2**40 pushes)
_SEQ_MASK = (1 << _SEQ_BITS) - 1


class _Node:
    """A run of blocks: ``ids[k]`` is the block at chain position ``start + k``."""

    __slots__ = ("ids", "kids", "live", "marks", "parent", "seq", "sizes", "start", "tail")

    def __init__(self, parent: _Node | None, start: int, ids: list[Hashable], sizes: list[int]) -> None:
        self.parent, self.start, self.ids, self.sizes = parent, start, ids, sizes
        self.kids: set[_Node] = set()  # the nodes hanging off the last block
        self.tail: Stamp = _NEVER  # the last block's time (marks at or after it, and evicted children's)
        self.marks: list[tuple[int, Stamp]] = []  # max-heap by position (−pos) of marks before the last block
        self.seq = -1  # the heap entry that is current for this node (-1: none)
        self.live = True


class DeviceTree:
    """Blocks under a byte budget, evicted least recently used leaf first.

    Args:
        capacity: budget in bytes.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.counters = TierCounters()
        self.nbytes = 0
        self._node: dict[Hashable, _Node] = {}  # block → the node holding it
        # heap of leaf entries ``time << _SEQ_BITS | entry``: plain ints, compared faster than tuples;
        # entries no longer current are skipped
        self._leaves: list[int] = []
        self._queued: dict[int, _Node] = {}  # entry → its node, while the entry is in the heap
        self._order = itertools.count()
        self._seq = itertools.count()
        self._smallest: int | None = None  # the smallest block size added (bounds an eviction's scan)
        self._largest: int | None = None  # the largest (equal to the smallest: every block is that size)

    def __len__(self) -> int:
        return len(self._node)

    def __contains__(self, block: Hashable) -> bool:
        return block in self._node

    def clear(self) -> None:
        """Forget every block (counters stay), unlinking the nodes (a node and its children refer to each
        other) so they are freed at once."""
        for node in self._node.values():
            node.parent, node.kids = None, set()
        self._node.clear()
        self._leaves.clear()
        self._queued.clear()
        self.nbytes = 0

    def match(self, ids: Sequence[Hashable], limit: int, *, guess: int | None = None) -> int:
        """How many leading ``ids[:limit]`` are held (binary search: a held id's ancestors are held; the last
        one is tried first, as a chain already used is held whole, then ``guess``, the caller's estimate,
        checked by two lookups)."""
        held = self._node
        if limit > 0 and ids[limit - 1] in held:
            return limit
        lo, hi = 0, limit - 1  # ids[:lo] held; ids[hi:] not held
        if guess is not None and 0 <= guess < limit:
            if guess == 0 or ids[guess - 1] in held:
                if ids[guess] not in held:
                    return guess
                lo = guess + 1
            else:
                hi = guess - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ids[mid - 1] in held:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def use(
        self,
        ids: Sequence[Hashable],
        end: int,
        size_of: Callable[[int, int], list[int]],
        *,
        guess: int | None = None,
    ) -> None:
        """Blocks ``ids[:end]`` are in use now: those not held are added (``size_of(i, j)`` gives the
        sizes of blocks ``[i, j)`` in bytes; leaves are evicted to fit, never the block the new ones hang
        off) and the last one becomes the most recently used, its ancestors with it. A run that cannot fit
        even with every other leaf evicted is added as far as it fits (``guess``: how many are likely held
        already, see `match`). Cost: a binary search, then the blocks added and evicted."""
        if end <= 0:
            return
        held = self._node
        first = end if ids[end - 1] in held else self.match(ids, end, guess=guess)
        if first < end:
            parent = held[ids[first - 1]] if first > 0 else None
            sizes = size_of(first, end)
            total = sum(sizes)
            if total > self.capacity and max(sizes) > self.capacity:  # larger than the whole budget: the
                sizes = sizes[: next(k for k, n in enumerate(sizes) if n > self.capacity)]  # chain stops
                total = sum(sizes)
            if self.nbytes + total > self.capacity:
                self._evict(self.nbytes + total - self.capacity, parent, first - 1)
            room, fit = self.capacity - self.nbytes, len(sizes)
            if total > room:  # everything evictable is gone: the chain stops where the budget does
                fit, total = 0, 0
                while fit < len(sizes) and total + sizes[fit] <= room:
                    total += sizes[fit]
                    fit += 1
            end = first + fit
            if fit:
                self._add(ids, first, end, sizes[:fit], total, parent)
        if end > 0:  # the last block is used now: its node's time, or a mark inside the node
            node, stamp = held[ids[end - 1]], next(self._order)
            if end == node.start + len(node.ids):
                node.tail = stamp  # the newest there is
                if not node.kids and node.seq < 0:  # a leaf's entry already in the heap stays (`_evict`)
                    self._push(node)
            else:
                heapq.heappush(node.marks, (-(end - 1), stamp))

    # --- adding ---

    def _add(
        self,
        ids: Sequence[Hashable],
        first: int,
        end: int,
        sizes: list[int],
        total: int,
        parent: _Node | None,
    ) -> None:
        """Hang ``ids[first:end]`` (none held) after chain position ``first − 1`` in ``parent``."""
        run = ids[first:end]
        if parent is not None and first < parent.start + len(parent.ids):  # a branch inside a run: split
            parent = self._split(parent, first)
        if parent is not None and not parent.kids:  # the run continues a leaf: extend it
            if parent.tail != _NEVER:
                heapq.heappush(parent.marks, (-(first - 1), parent.tail))
            parent.tail = _NEVER
            parent.seq = -1
            parent.ids += run
            parent.sizes += sizes
            node = parent
        else:
            node = _Node(parent, first, list(run), sizes)
            if parent is not None:
                parent.kids.add(node)
        self._node.update(zip(run, itertools.repeat(node)))
        least, most = min(sizes), max(sizes)
        if self._smallest is None or least < self._smallest:
            self._smallest = least
        if self._largest is None or most > self._largest:
            self._largest = most
        self.nbytes += total
        self.counters.entries_written += len(run)
        self.counters.bytes_written += total

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node`` before chain position ``at``: the blocks from ``at`` on (with the children and the
        marks there) and those before become two nodes, the second a child of the first. The smaller part is
        the one moved to a new node (its blocks re-pointed). Returns the first node (ending at ``at − 1``)."""
        k = at - node.start
        if 2 * k < len(node.ids):  # the head is smaller: it moves to a new node above ``node``
            head = _Node(node.parent, node.start, node.ids[:k], node.sizes[:k])
            del node.ids[:k], node.sizes[:k]
            node.start = at
            if node.parent is not None:
                node.parent.kids.discard(node)
                node.parent.kids.add(head)
            node.parent, head.kids = head, {node}
            head.marks = [m for m in node.marks if -m[0] < at]
            node.marks = [m for m in node.marks if -m[0] >= at]
            heapq.heapify(head.marks)
            heapq.heapify(node.marks)
            self._fold(head)
            self._node.update(zip(head.ids, itertools.repeat(head)))
            return head  # ``node`` keeps its time, children and heap entry
        tail = _Node(node, at, node.ids[k:], node.sizes[k:])
        del node.ids[k:], node.sizes[k:]
        tail.kids, tail.tail = node.kids, node.tail
        for child in tail.kids:
            child.parent = tail
        tail.marks = [m for m in node.marks if -m[0] >= at]
        kept = [m for m in node.marks if -m[0] < at]
        heapq.heapify(tail.marks)
        heapq.heapify(kept)
        node.marks, node.tail, node.kids, node.seq = kept, _NEVER, {tail}, -1
        self._fold(node)
        self._node.update(zip(tail.ids, itertools.repeat(tail)))
        if not tail.kids and tail.tail != _NEVER:
            self._push(tail)
        return node

    # --- time ---

    def _fold(self, node: _Node) -> bool:
        """Take the marks at ``node``'s last block into its time; whether that made it newer."""
        last, newer = node.start + len(node.ids) - 1, False
        while node.marks and -node.marks[0][0] >= last:
            _, stamp = heapq.heappop(node.marks)
            if stamp > node.tail:
                node.tail, newer = stamp, True
        return newer

    def _push(self, node: _Node) -> None:
        seq = node.seq = next(self._seq)
        self._queued[seq] = node
        heapq.heappush(self._leaves, (node.tail << _SEQ_BITS) + seq)

    # --- eviction ---

    def _evict(self, need: int, protect: _Node | None, protect_pos: int) -> None:
        """Evict least recently used leaf blocks until ``need`` bytes are free or no leaf but the protected
        block (chain position ``protect_pos`` of ``protect``) is left."""
        heap, queued, skipped, pop = self._leaves, self._queued, [], heapq.heappop
        while need > 0 and heap:
            entry = pop(heap)
            seq, tail = entry & _SEQ_MASK, entry >> _SEQ_BITS
            node = queued.pop(seq)
            if node.seq != seq:
                continue  # not current: extended, split or pushed again since
            node.seq = -1  # its entry is taken
            if not node.live or node.kids:
                continue  # emptied, or no longer a leaf
            if tail != node.tail:  # used since it was pushed: back in at its time now
                self._push(node)
                continue
            stop = protect_pos + 1 if node is protect else node.start  # the first block that may not go
            marks = node.marks
            if marks and -marks[0][0] >= stop:
                stop = -marks[0][0] + 1
            need -= self._drop_tail(node, stop, need)
            if not node.ids:
                self._remove(node)
                continue
            if marks:
                self._fold(node)  # its new last block may carry a mark: its time then moves on
            if node is protect and node.start + len(node.ids) == protect_pos + 1:
                skipped.append(node)  # only the protected block is left: not this round
            else:
                self._push(node)
        for node in skipped:
            self._push(node)

    def _drop_tail(self, node: _Node, stop: int, need: int) -> int:
        """Drop blocks from ``node``'s tail, not below chain position ``stop``, until ``need`` bytes are
        freed; returns the bytes freed. The blocks looked at are at most those that could be needed (``need``
        over the smallest block size)."""
        sizes, ids, smallest = node.sizes, node.ids, self._smallest
        most = node.start + len(ids) - stop
        if most <= 0 or need <= 0:
            return 0
        if sizes[-1] >= need:  # one block is enough
            k, freed = 1, sizes[-1]
            del self._node[ids[-1]]
        elif smallest and smallest == self._largest:  # every block the same size
            k = min(most, -(-need // smallest))
            freed = k * smallest
            deque(map(self._node.__delitem__, ids[-k:]), maxlen=0)
        else:
            if smallest:
                most = min(most, need // smallest + 1)
            freed_by = list(itertools.accumulate(sizes[-1 : -most - 1 : -1]))  # freed by dropping k + 1
            k = min(most, bisect_left(freed_by, need) + 1)
            freed = freed_by[k - 1]
            deque(map(self._node.__delitem__, ids[-k:]), maxlen=0)
        del ids[-k:], sizes[-k:]
        self.nbytes -= freed
        self.counters.evictions += k
        return freed

    def _remove(self, node: _Node) -> None:
        """An emptied node: its parent's last block inherits its time and may become a leaf."""
        node.live = False
        parent = node.parent
        if parent is not None:
            parent.kids.discard(node)
            parent.tail = max(parent.tail, node.tail)
            if not parent.kids:
                self._push(parent)
