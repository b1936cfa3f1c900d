"""`reserve_blocks`: the cache layer gives block tables the blocks a forward needs, all or none; the model only
checks that its table covers the rows it writes (issue 14: the model computes, it does not allocate)."""

from __future__ import annotations

import pytest
import torch

from kvdiet.cache.block_pool import BlockPool, NoFreeBlocksError
from kvdiet.cache.reserve import reserve_blocks
from kvdiet.config import load_config
from kvdiet.model.transformer import Transformer


class FakePool:
    def __init__(self, num_blocks: int, block_size: int, *, growable: bool = False) -> None:
        self.blocks, self.block_size, self.growable = BlockPool(num_blocks, block_size), block_size, growable


class FakeTable:
    def __init__(self, pool: FakePool) -> None:
        self.pool, self.ids = pool, []

    def __len__(self) -> int:
        return len(self.ids)

    def reserve(self, num_tokens: int) -> None:
        need = -(-num_tokens // self.pool.block_size) - len(self.ids)
        if need > 0:
            self.ids.extend(self.pool.blocks.allocate(need))


def test_reserves_what_each_table_needs() -> None:
    pool = FakePool(8, 4)
    a, b = FakeTable(pool), FakeTable(pool)
    reserve_blocks([(a, 5), (b, 4)])
    assert (len(a), len(b), pool.blocks.num_free) == (2, 1, 5)
    reserve_blocks([(a, 8), (b, 1)])  # already covered: nothing more
    assert (len(a), len(b), pool.blocks.num_free) == (2, 1, 5)


def test_all_or_none() -> None:
    pool = FakePool(4, 4)
    a, b = FakeTable(pool), FakeTable(pool)
    with pytest.raises(NoFreeBlocksError, match="needs 5 more blocks, 4 are free"):
        reserve_blocks([(a, 8), (b, 12)])
    assert (len(a), len(b), pool.blocks.num_free) == (0, 0, 4)
    pool.blocks.check_integrity()


def test_the_model_checks_its_table_and_allocates_nothing() -> None:
    model = Transformer.from_config(load_config("v4.1-micro"), seed=0)
    bs = 4
    state = model.new_state(model.new_pool(4, block_size=bs, blocks=BlockPool(4, bs)))
    tokens = torch.arange(1, 7)
    with pytest.raises(ValueError, match="block table covers 0 tokens but the forward writes up to token 6"):
        model.prefill(state, tokens)
    assert state.num_tokens == 0 and state.table.pool.blocks.num_free == 4
    reserve_blocks([(state.table, 6)])
    model.prefill(state, tokens)
    assert state.num_tokens == 6 and state.table.pool.blocks.num_free == 2
    with pytest.raises(ValueError, match="covers 8 tokens but the forward writes up to token 9"):
        model.prefill(state, torch.arange(1, 4))
    assert state.num_tokens == 6 and len(state.table) == 2
