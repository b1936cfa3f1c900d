"""Block ids of the paged device pool: ref counts, an LRU free queue, and the prefix index over full blocks.

Control plane only (ints, hashes, token ids; no tensors). A block covers ``block_size`` consecutive tokens
of every KV-source layer's main-KV entries and index keys (the tensors live in
`kvdiet.model.paged_pool`). Every block is in exactly one state:

- **used**: ref count > 0 (in some request's block table);
- **cached**: ref count 0 but published under a prefix hash, so a later request can take it back;
- **free**: ref count 0, no hash.

Cached and free blocks together form the free queue, least recently released first (vLLM v1's
``FreeKVCacheBlockQueue``). Allocation pops from the front and evicts a cached block's hash; a prefix hit
takes a cached block out of the queue in O(1) (an ``OrderedDict`` keyed by block id). A request's blocks
are released tail first, so a shared prefix outlives its private suffix. All methods are thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvdiet.cache.counters import TierCounters

__all__ = ["BlockPool", "NoFreeBlocksError"]


class NoFreeBlocksError(RuntimeError):
    """The pool has fewer free (or evictable cached) blocks than a request needs."""


class BlockPool:
    """Ref counts and the free queue of ``num_blocks`` blocks of ``block_size`` tokens.

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` below 1.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.block_size = block_size
        self.counters = TierCounters()
        self._ref = [0] * num_blocks  # per block
        self._hash: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # published block → (hash, token ids)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._by_hash: dict[bytes, int] = {}
        self._lock = threading.RLock()

    # --- sizes ---

    @property
    def num_blocks(self) -> int:
        return len(self._ref)

    @property
    def num_free(self) -> int:
        """Blocks a request could allocate now (free + cached)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks still findable by prefix hash."""
        with self._lock:
            return sum(1 for b in self._hash if self._ref[b] == 0)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def grow(self, extra: int) -> None:
        """Add ``extra`` free blocks at the end of the id range (private, growable pools only)."""
        with self._lock:
            start = len(self._ref)
            self._ref.extend([0] * extra)
            for b in range(start, start + extra):
                self._free[b] = None

    # --- allocation ---

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the front of the free queue (ref count 1 each); cached ones lose their hash.

        Raises:
            NoFreeBlocksError: fewer than ``n`` blocks are free or cached (nothing changes then).
        """
        with self._lock:
            if n > len(self._free):
                raise NoFreeBlocksError(f"need {n} blocks, {len(self._free)} free of {self.num_blocks}")
            out = []
            for _ in range(n):
                b, _ = self._free.popitem(last=False)
                published = self._hash.pop(b, None)
                if published is not None:
                    del self._by_hash[published[0]]
                    self.counters.evictions += 1
                self._ref[b] = 1
                out.append(b)
            return out

    def _check_ids(self, block_ids: Sequence[int]) -> None:
        bad = [b for b in block_ids if not 0 <= b < len(self._ref)]
        if bad:
            raise ValueError(f"block ids {bad} outside [0, {len(self._ref)})")

    def take(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block (a prefix hit); a cached block leaves the free queue.

        Raises:
            ValueError: an id out of range, or a free block holding nothing (nothing changes then).
        """
        with self._lock:
            self._check_ids(block_ids)
            bad = [b for b in block_ids if self._ref[b] == 0 and b not in self._hash]
            if bad:
                raise ValueError(f"blocks {bad} are free and hold nothing to share")
            for b in block_ids:
                if self._ref[b] == 0:
                    del self._free[b]
                self._ref[b] += 1

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block, last block first; at zero it joins the back of the free queue.

        Raises:
            ValueError: a block id repeats in ``block_ids`` or its ref count is already 0 (double free, case
                B24); nothing changes then.
        """
        with self._lock:
            self._check_ids(block_ids)
            if len(set(block_ids)) != len(block_ids):
                raise ValueError(f"block ids repeat in one release: {list(block_ids)}")
            bad = [b for b in block_ids if self._ref[b] < 1]
            if bad:
                raise ValueError(f"blocks {bad} are not referenced (double free)")
            for b in reversed(block_ids):
                self._ref[b] -= 1
                if self._ref[b] == 0:
                    self._free[b] = None

    # --- prefix index ---

    def publish(self, block_id: int, block_hash: bytes, tokens: Sequence[int]) -> bool:
        """Make a full, referenced block findable under ``block_hash``; False if that hash already has a block
        (the existing one stays canonical) or the block is already published.

        Raises:
            ValueError: ``tokens`` is not one block long, or the block is not referenced.
        """
        if len(tokens) != self.block_size:
            raise ValueError(f"a published block holds {self.block_size} tokens, got {len(tokens)}")
        with self._lock:
            self._check_ids([block_id])
            if self._ref[block_id] < 1:
                raise ValueError(f"block {block_id} is not referenced; only live blocks are published")
            if block_id in self._hash or block_hash in self._by_hash:
                return False
            self._hash[block_id] = (block_hash, tuple(tokens))
            self._by_hash[block_hash] = block_id
            return True

    def match(self, hashes: Sequence[bytes], token_blocks: Sequence[Sequence[int]]) -> list[int]:
        """Block ids of the longest run of ``hashes`` held here whose stored token ids equal ``token_blocks``
        (a hash collision is a miss). Takes no reference: call `take` under the same caller's control."""
        out = []
        with self._lock:
            for h, tokens in zip(hashes, token_blocks, strict=True):
                b = self._by_hash.get(h)
                if b is None or self._hash[b][1] != tuple(tokens):
                    break
                out.append(b)
        return out

    def lookup_and_take(self, hashes: Sequence[bytes], token_blocks: Sequence[Sequence[int]]) -> list[int]:
        """`match` then `take` atomically (no eviction can slip in between)."""
        with self._lock:
            ids = self.match(hashes, token_blocks)
            self.take(ids)
            self.counters.lookups += len(hashes)
            self.counters.hits += len(ids)
            return ids

    def block_hash(self, block_id: int) -> bytes | None:
        published = self._hash.get(block_id)
        return None if published is None else published[0]

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def check_integrity(self) -> None:
        """Assert the pool's invariants: every block is exactly one of used / cached / free; the free queue
        holds exactly the unreferenced blocks, each once; the hash index and the blocks agree.

        Raises:
            AssertionError: naming the first broken invariant.
        """
        with self._lock:
            assert all(r >= 0 for r in self._ref), "negative ref count"
            unref = {b for b, r in enumerate(self._ref) if r == 0}
            assert set(self._free) == unref and len(self._free) == len(unref), (
                "free queue != unreferenced blocks"
            )
            for h, b in self._by_hash.items():
                assert self._hash.get(b, (None,))[0] == h, (
                    f"hash index points at block {b} holding another hash"
                )
            assert len(self._hash) == len(self._by_hash), "a block holds a hash missing from the index"
            used, cached = self.num_blocks - len(unref), sum(1 for b in unref if b in self._hash)
            free = len(unref) - cached
            assert used + cached + free == self.num_blocks, "used + cached + free != total"
