"""Who hands out the block ids of a paged pool: the `BlockAllocator` protocol, and `PrivateBlocks`, the
allocator of a model used on its own.

The model computes into blocks; it does not decide which blocks a request gets (DESIGN.md §3). Under an
engine the cache layer passes its `kvdiet.cache.block_pool.BlockPool` (ref counts, LRU free queue, prefix
index), which satisfies `BlockAllocator`. A model used without an engine (`Transformer.new_state` without a
pool) gets `PrivateBlocks`: sequential ids, one owner per block, no prefix index, grown on demand. Pure
data (ints only); this module does not know tensors.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

__all__ = ["BlockAllocator", "PrivateBlocks"]


class BlockAllocator(Protocol):
    """The calls the model side makes on a pool's block ids (`kvdiet.cache.block_pool.BlockPool` has them)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free(self) -> int: ...

    def allocate(self, n: int) -> list[int]: ...

    def release(self, block_ids: Sequence[int]) -> None: ...

    def grow(self, extra: int) -> None: ...


class PrivateBlocks:
    """Block ids ``0 .. num_blocks−1`` of a private pool: each block has at most one owner (a request's block
    table); released blocks join the back of the free queue, last block first, as in the cache layer's pool.

    Raises:
        ValueError: ``num_blocks`` below 1.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"need num_blocks >= 1, got {num_blocks}")
        self._size = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_blocks(self) -> int:
        return self._size

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` ids from the front of the free queue.

        Raises:
            ValueError: fewer than ``n`` are free (the pool grows first; nothing changes then).
        """
        if n > len(self._free):
            raise ValueError(f"need {n} blocks, {len(self._free)} free of {self._size}: grow the pool first")
        return [self._free.popitem(last=False)[0] for _ in range(n)]

    def release(self, block_ids: Sequence[int]) -> None:
        """Return ``block_ids`` to the free queue, last first.

        Raises:
            ValueError: an id out of range, repeated, or already free (double free); nothing changes then.
        """
        bad = [b for b in block_ids if not 0 <= b < self._size or b in self._free]
        if bad or len(set(block_ids)) != len(block_ids):
            raise ValueError(f"blocks {list(block_ids)} are not all allocated, once each (bad: {bad})")
        self._free.update(dict.fromkeys(reversed(block_ids)))

    def grow(self, extra: int) -> None:
        """Add ``extra`` free ids at the end of the id range."""
        self._free.update(dict.fromkeys(range(self._size, self._size + extra)))
        self._size += extra
