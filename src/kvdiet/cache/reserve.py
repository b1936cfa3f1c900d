"""Reserving device blocks before a forward (nano-vllm's ``may_append``): the cache layer allocates, the model
only computes into the blocks its table already holds.

Control plane only: a table is anything with a ``pool`` (``block_size``, ``growable``, ``blocks``: the
`kvdiet.cache.block_pool.BlockPool`), a length in blocks and ``reserve(num_tokens)``
(`kvdiet.model.state.BlockTable`). Nothing here knows tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvdiet.cache.block_pool import BlockPool, NoFreeBlocksError

__all__ = ["reserve_blocks"]


class _Pool(Protocol):
    block_size: int
    growable: bool
    blocks: BlockPool


class _Table(Protocol):
    pool: _Pool

    def __len__(self) -> int: ...

    def reserve(self, num_tokens: int) -> None: ...


def reserve_blocks(demands: Sequence[tuple[_Table, int]]) -> None:
    """Give each table the blocks its first ``num_tokens`` tokens need, all or none.

    Args:
        demands: ``(table, num_tokens)`` pairs: the tokens each table must cover after the forward (its
            tokens so far plus the chunk). Tables on a growable pool (a model used on its own) always fit.
    Raises:
        NoFreeBlocksError: a pool has fewer free (or evictable cached) blocks than its tables need together;
            nothing is allocated then.
    """
    need: dict[int, int] = {}
    for table, num_tokens in demands:
        pool = table.pool
        if pool.growable:
            continue
        blocks = -(-num_tokens // pool.block_size) - len(table)
        need[id(pool)] = need.get(id(pool), 0) + max(0, blocks)
        if need[id(pool)] > pool.blocks.num_free:
            raise NoFreeBlocksError(
                f"the batch needs {need[id(pool)]} more block{'' if need[id(pool)] == 1 else 's'}, "
                f"{pool.blocks.num_free} {'is' if pool.blocks.num_free == 1 else 'are'} free"
            )
    for table, num_tokens in demands:
        table.reserve(num_tokens)
