"""The paged device pool takes its block ids from an allocator (issue 14: the model does not allocate): the
cache layer's `BlockPool` under an engine, or a private growable `PrivateBlocks` for a model on its own."""

from __future__ import annotations

import pytest
import torch

from kvdiet.cache.block_pool import BlockPool, NoFreeBlocksError
from kvdiet.config import load_config
from kvdiet.model.block_ids import PrivateBlocks
from kvdiet.model.state import PagedEntries
from kvdiet.model.transformer import Transformer


@pytest.fixture(scope="module")
def micro() -> Transformer:
    return Transformer.from_config(load_config("v4.1-micro"), seed=0)


def test_private_blocks_hand_out_ids_in_order_and_take_them_back_last_first() -> None:
    blocks = PrivateBlocks(4)
    assert blocks.allocate(3) == [0, 1, 2] and blocks.num_free == 1
    blocks.release([0, 1])
    assert blocks.allocate(3) == [3, 1, 0]  # the free queue: 3, then the released tail first
    blocks.grow(2)
    assert (blocks.num_blocks, blocks.num_free) == (6, 2) and blocks.allocate(2) == [4, 5]


@pytest.mark.parametrize("bad", [[7], [2, 2]])
def test_private_blocks_refuse_a_bad_release_and_change_nothing(bad: list[int]) -> None:
    blocks = PrivateBlocks(4)
    blocks.allocate(3)
    with pytest.raises(ValueError, match="not all allocated"):
        blocks.release(bad)
    with pytest.raises(ValueError, match="not all allocated"):
        blocks.release([3])  # free already
    assert blocks.num_free == 1
    with pytest.raises(ValueError, match="need 2 blocks, 1 free of 4"):
        blocks.allocate(2)
    with pytest.raises(ValueError, match="num_blocks >= 1"):
        PrivateBlocks(0)


def test_a_pool_without_an_allocator_grows(micro: Transformer) -> None:
    pool = micro.new_pool(1, block_size=4)
    assert pool.growable and isinstance(pool.blocks, PrivateBlocks)
    ids = pool.allocate(3)
    assert ids == [0, 1, 2] and pool.num_blocks == 3
    assert pool.rows(micro.plan.kv_sources[0], "main").shape[0] == 3 * pool.entries_per_block(
        micro.plan.kv_sources[0]
    )


def test_a_pool_on_the_cache_layers_block_pool_is_fixed(micro: Transformer) -> None:
    blocks = BlockPool(2, 4)
    pool = micro.new_pool(2, block_size=4, blocks=blocks)
    assert not pool.growable and pool.blocks is blocks
    state = micro.new_state(pool)
    state.table.reserve(8)
    assert blocks.num_free == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    state.table.release()
    assert blocks.num_free == 2
    blocks.check_integrity()
    with pytest.raises(ValueError, match="the allocator holds 2 blocks, the pool 3"):
        micro.new_pool(3, block_size=4, blocks=blocks)


def test_a_released_table_reserved_again_reads_its_new_ids(micro: Transformer) -> None:
    """`BlockTable.tensor` is cached until the table changes length: a release empties it, so a table reserved
    again to the same length reads its new blocks (the decode step's block tables are built from it)."""
    pool = micro.new_pool(4, block_size=4)
    other, state = micro.new_state(pool), micro.new_state(pool)
    state.table.reserve(8)
    assert state.table.tensor().tolist() == [0, 1]
    other.table.reserve(4)  # takes the next free block
    state.table.release()
    state.table.reserve(8)
    assert state.table.ids != [0, 1] and state.table.tensor().tolist() == state.table.ids


def test_a_block_round_trips_as_bytes(micro: Transformer) -> None:
    pool = micro.new_pool(2, block_size=4)
    state = micro.new_state(pool)
    micro.prefill(state, list(range(1, 9)))
    first, second = state.table.ids
    payload = pool.read_block(first)
    assert len(payload) == pool.block_bytes and payload != pool.read_block(second)
    pool.write_block(second, payload)
    assert pool.read_block(second) == payload
    with pytest.raises(ValueError, match=f"a block payload is {pool.block_bytes} bytes, got 3"):
        pool.write_block(first, b"abc")


def test_write_each_stores_what_write_rows_would_and_refuses_before_writing(micro: Transformer) -> None:
    """A batched step's new entries, one per request, in one copy: the same pool rows as `write_rows` one by one
    (requests holding 0, 3 and 5 entries: different blocks and offsets; all on one pool, or one on its own); a
    store without room for its entry, or a row count that does not match, fails before any store changes."""
    layer = micro.plan.kv_sources[0]
    shared, private = micro.new_pool(4, block_size=4), micro.new_pool(2, block_size=4)
    per_block = shared.entries_per_block(layer)
    codec = shared.codecs["main"]
    rows = codec.encode(torch.randn(3, codec.dim, generator=torch.Generator().manual_seed(0)))

    def states(pools, helds=(0, 3, 5), room=1):
        out = []
        for pool, held in zip(pools, helds, strict=True):
            s = micro.new_state(pool)
            s.table.reserve(-(-(held + room) // per_block) * 4)  # 4 tokens a block
            if held:
                s.main[layer].write_rows(codec.encode(torch.full((held, codec.dim), float(held))))
            out.append(s)
        return out

    for pools in ([shared] * 3, [shared, private, shared]):
        one_by_one, batched = states(pools), states(pools)
        for s, row in zip(one_by_one, rows.split(1), strict=True):
            s.main[layer].write_rows(row)
        PagedEntries.write_each([s.main[layer] for s in batched], rows)
        for m, (a, b) in enumerate(zip(one_by_one, batched, strict=True)):
            assert len(b.main[layer]) == len(a.main[layer]) == (0, 3, 5)[m] + 1
            assert torch.equal(b.main[layer].raw(), a.main[layer].raw())
            assert torch.equal(b.main[layer].raw()[-1], rows[m])
    full = states([shared] * 3, helds=(1, 3, 2 * per_block), room=0)  # the last one's blocks are full
    kept = [s.main[layer].raw() for s in full]
    with pytest.raises(ValueError, match="need"):
        PagedEntries.write_each([s.main[layer] for s in full], rows)
    with pytest.raises(ValueError, match="2 stores for 3 rows"):
        PagedEntries.write_each([s.main[layer] for s in full[:2]], rows)
    assert all(torch.equal(s.main[layer].raw(), k) for s, k in zip(full, kept, strict=True))
