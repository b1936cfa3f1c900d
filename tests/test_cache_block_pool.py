"""BlockPool: ref counts, the LRU free queue, the prefix index, failure atomicity and thread safety."""

from __future__ import annotations

import random
import sys
import threading

import pytest

from kvdiet.cache.block_pool import BlockPool, NoFreeBlocksError
from kvdiet.cache.prefix import block_hashes

BS = 4
FP = b"test-fingerprint"


def _h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def _toks(i: int) -> tuple[int, ...]:
    return tuple(range(i * BS, (i + 1) * BS))


def _snapshot(pool: BlockPool) -> tuple:
    """Everything observable about a pool, including the free-queue order and the counters."""
    return (
        list(pool._free),
        dict(pool._by_hash),
        [(pool.ref_count(b), pool.block_hash(b)) for b in range(pool.num_blocks)],
        pool.counters.as_dict(),
    )


# --- construction and sizes ---


def test_rejects_bad_sizes() -> None:
    for n, bs in [(0, 4), (4, 0), (-1, 4)]:
        with pytest.raises(ValueError, match="num_blocks >= 1 and block_size >= 1"):
            BlockPool(n, bs)


def test_fresh_pool() -> None:
    pool = BlockPool(5, BS)
    assert (pool.num_blocks, pool.num_free, pool.num_used, pool.num_cached) == (5, 5, 0, 0)
    assert list(pool._free) == [0, 1, 2, 3, 4]
    assert all(pool.ref_count(b) == 0 and pool.block_hash(b) is None for b in range(5))
    pool.check_integrity()


# --- allocate / release / LRU order ---


def test_allocate_takes_front_of_queue_with_ref_one() -> None:
    pool = BlockPool(6, BS)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert [pool.ref_count(b) for b in range(6)] == [1, 1, 1, 1, 1, 0]
    assert (pool.num_free, pool.num_used) == (1, 5)
    assert pool.allocate(0) == []
    pool.check_integrity()


def test_release_tail_first_to_back_of_queue() -> None:
    pool = BlockPool(6, BS)
    a = pool.allocate(3)  # [0, 1, 2]
    b = pool.allocate(2)  # [3, 4]
    pool.release(a)
    # 5 was never used; a's tail (2) joins the queue before its head (0).
    assert list(pool._free) == [5, 2, 1, 0]
    pool.release(b)
    assert list(pool._free) == [5, 2, 1, 0, 4, 3]
    # Allocation follows the queue: least recently released first.
    assert pool.allocate(6) == [5, 2, 1, 0, 4, 3]
    pool.check_integrity()


def test_eviction_order_and_counter() -> None:
    pool = BlockPool(4, BS)
    ids = pool.allocate(3)
    for i, b in enumerate(ids):
        assert pool.publish(b, _h(i), _toks(i))
    pool.release(ids)
    assert list(pool._free) == [3, 2, 1, 0]
    assert (pool.num_cached, pool.num_free) == (3, 4)

    # The never-hashed block goes first and evicts nothing.
    assert pool.allocate(1) == [3]
    assert pool.counters.evictions == 0
    # Next: the tail of the released request (block 2), losing its hash.
    assert pool.allocate(1) == [2]
    assert pool.counters.evictions == 1
    assert pool.block_hash(2) is None and _h(2) not in pool._by_hash
    assert pool.num_cached == 2
    # The shared prefix (blocks 0, 1) is still findable.
    assert pool.match([_h(0), _h(1), _h(2)], [_toks(0), _toks(1), _toks(2)]) == [0, 1]
    assert pool.allocate(2) == [1, 0]
    assert pool.counters.evictions == 3
    assert pool.num_cached == 0 and pool._by_hash == {}
    pool.check_integrity()


def test_shared_block_needs_every_reference_released() -> None:
    pool = BlockPool(3, BS)
    [b] = pool.allocate(1)
    pool.publish(b, _h(0), _toks(0))
    pool.take([b])
    assert pool.ref_count(b) == 2
    pool.release([b])
    assert pool.ref_count(b) == 1 and b not in pool._free
    pool.release([b])
    assert pool.ref_count(b) == 0 and list(pool._free)[-1] == b
    with pytest.raises(ValueError, match="double free"):
        pool.release([b])
    pool.check_integrity()


# --- prefix index: publish / match / take / lookup_and_take ---


def test_prefix_hit_takes_cached_block_out_of_queue() -> None:
    pool = BlockPool(4, BS)
    ids = pool.allocate(2)
    pool.publish(ids[0], _h(0), _toks(0))
    pool.publish(ids[1], _h(1), _toks(1))
    pool.release(ids)
    assert pool.num_free == 4

    got = pool.lookup_and_take([_h(0), _h(1)], [_toks(0), _toks(1)])
    assert got == [0, 1]
    assert pool.num_free == 2 and pool.num_used == 2 and pool.num_cached == 0
    assert [pool.ref_count(b) for b in got] == [1, 1]
    assert list(pool._free) == [2, 3]
    # Hash survives the hit; allocating everything left does not evict it.
    assert pool.allocate(2) == [2, 3]
    assert pool.counters.evictions == 0
    assert pool.block_hash(0) == _h(0)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    # Released again: goes to the back of the queue, still cached.
    pool.release([0, 1])
    assert list(pool._free) == [1, 0]
    assert pool.num_cached == 2
    pool.check_integrity()


def test_take_adds_reference_to_used_block_and_rejects_plain_free() -> None:
    pool = BlockPool(3, BS)
    [b] = pool.allocate(1)
    pool.take([b])  # a used block may be taken even without a hash
    assert pool.ref_count(b) == 2
    with pytest.raises(ValueError, match="hold nothing to share"):
        pool.take([2])
    assert pool.ref_count(2) == 0 and 2 in pool._free
    pool.check_integrity()


def test_failed_take_changes_nothing() -> None:
    pool = BlockPool(4, BS)
    [a] = pool.allocate(1)
    pool.publish(a, _h(0), _toks(0))
    pool.release([a])  # a is cached
    before = _snapshot(pool)
    with pytest.raises(ValueError, match="nothing to share"):
        pool.take([a, 3])  # 3 is plain free
    assert _snapshot(pool) == before
    assert pool.ref_count(a) == 0 and a in pool._free
    pool.check_integrity()


def test_match_stops_at_first_miss_and_takes_nothing() -> None:
    pool = BlockPool(6, BS)
    ids = pool.allocate(4)
    for i in (0, 1, 3):  # block 2 is never published
        pool.publish(ids[i], _h(i), _toks(i))
    before = _snapshot(pool)
    hashes = [_h(i) for i in range(4)]
    toks = [_toks(i) for i in range(4)]
    assert pool.match(hashes, toks) == [0, 1]
    assert pool.match(hashes[1:], toks[1:]) == [1]
    assert pool.match([], []) == []
    assert pool.match([_h(99)], [_toks(0)]) == []
    assert _snapshot(pool) == before  # match takes no reference
    with pytest.raises(ValueError):  # hashes and token blocks must pair up
        pool.match(hashes, toks[:2])


def test_match_collision_is_a_miss() -> None:
    pool = BlockPool(4, BS)
    ids = pool.allocate(3)
    for i, b in enumerate(ids):
        pool.publish(b, _h(i), _toks(i))
    # Same hash, different stored tokens: a collision, so a miss from there on.
    other = (7, 7, 7, 7)
    assert pool.match([_h(0)], [other]) == []
    assert pool.match([_h(0), _h(1), _h(2)], [_toks(0), other, _toks(2)]) == [0]
    assert pool.match([_h(0), _h(1), _h(2)], [list(_toks(0)), list(_toks(1)), list(_toks(2))]) == [0, 1, 2]
    pool.release(ids)
    before = _snapshot(pool)
    assert pool.lookup_and_take([_h(0), _h(1)], [_toks(0), other]) == [0]
    assert pool.ref_count(0) == 1 and pool.ref_count(1) == 0
    assert (pool.counters.lookups, pool.counters.hits) == (2, 1)
    assert list(pool._free) == [x for x in before[0] if x != 0]
    pool.check_integrity()


def test_publish_rules() -> None:
    pool = BlockPool(4, BS)
    a, b = pool.allocate(2)
    assert pool.publish(a, _h(0), _toks(0)) is True
    # The same hash again keeps the first block canonical.
    assert pool.publish(b, _h(0), _toks(0)) is False
    assert pool.block_hash(b) is None
    assert pool._by_hash == {_h(0): a}
    assert pool.match([_h(0)], [_toks(0)]) == [a]
    # A block publishes once.
    assert pool.publish(a, _h(1), _toks(1)) is False
    assert pool.block_hash(a) == _h(0) and _h(1) not in pool._by_hash
    with pytest.raises(ValueError, match="holds 4 tokens, got 3"):
        pool.publish(b, _h(2), (1, 2, 3))
    with pytest.raises(ValueError, match="not referenced"):
        pool.publish(3, _h(3), _toks(3))
    assert pool.block_hash(3) is None and pool.block_hash(b) is None
    pool.check_integrity()


def test_published_tokens_are_copied() -> None:
    pool = BlockPool(2, BS)
    [b] = pool.allocate(1)
    toks = list(_toks(0))
    pool.publish(b, _h(0), toks)
    toks[0] = 999
    assert pool.match([_h(0)], [_toks(0)]) == [b]


# --- failure atomicity ---


def test_no_free_blocks_changes_nothing() -> None:
    pool = BlockPool(4, BS)
    ids = pool.allocate(2)
    pool.publish(ids[0], _h(0), _toks(0))
    pool.release(ids[:1])
    before = _snapshot(pool)
    with pytest.raises(NoFreeBlocksError, match="need 4 blocks, 3 free of 4"):
        pool.allocate(4)
    assert _snapshot(pool) == before
    assert pool.num_cached == 1 and pool.counters.evictions == 0
    pool.check_integrity()


def test_double_release_request_b24() -> None:
    """Case B24: a request of several blocks aborted twice; the second abort raises and changes nothing."""
    pool = BlockPool(8, BS)
    other = pool.allocate(2)
    req = pool.allocate(4)
    pool.publish(req[0], _h(0), _toks(0))
    pool.release(req)
    before = _snapshot(pool)
    with pytest.raises(ValueError, match="double free"):
        pool.release(req)
    assert _snapshot(pool) == before
    pool.release(other)
    assert pool.num_free == pool.num_blocks == 8
    assert len(set(pool._free)) == 8
    pool.check_integrity()
    # Every block can be allocated again, each exactly once.
    again = pool.allocate(8)
    assert sorted(again) == list(range(8))
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.check_integrity()


def test_partial_double_release_changes_nothing() -> None:
    pool = BlockPool(4, BS)
    a = pool.allocate(2)
    b = pool.allocate(1)
    pool.release(b)
    before = _snapshot(pool)
    with pytest.raises(ValueError, match=rf"blocks \[{b[0]}\] are not referenced"):
        pool.release([*a, *b])  # a is live, b already freed
    assert _snapshot(pool) == before
    assert [pool.ref_count(x) for x in a] == [1, 1]


def test_repeated_ids_in_one_release() -> None:
    pool = BlockPool(4, BS)
    [b] = pool.allocate(1)
    pool.publish(b, _h(0), _toks(0))
    pool.take([b])  # ref 2: dropping twice would be legal one call at a time
    before = _snapshot(pool)
    with pytest.raises(ValueError, match="repeat in one release"):
        pool.release([b, b])
    assert _snapshot(pool) == before
    assert pool.ref_count(b) == 2
    pool.release([b])
    pool.release([b])
    assert pool.num_free == 4
    pool.check_integrity()


# --- grow ---


def test_grow_appends_free_blocks_at_the_back() -> None:
    pool = BlockPool(3, BS)
    a = pool.allocate(2)
    pool.release(a)  # queue: 2, 1, 0
    pool.grow(2)
    assert pool.num_blocks == 5 and pool.num_free == 5
    assert list(pool._free) == [2, 1, 0, 3, 4]
    pool.check_integrity()
    assert pool.allocate(5) == [2, 1, 0, 3, 4]
    assert all(pool.ref_count(b) == 1 for b in range(5))
    pool.grow(0)
    assert pool.num_blocks == 5 and pool.num_free == 0
    pool.check_integrity()


# --- check_integrity ---


def test_random_sequence_keeps_integrity() -> None:
    rng = random.Random(0)
    pool = BlockPool(16, BS)
    refs = [0] * 16  # reference model of the ref counts
    live: list[list[int]] = []
    hashed: dict[bytes, int] = {}
    ops = {"alloc": 0, "release": 0, "take": 0, "grow": 0, "nofree": 0, "double": 0}
    for _ in range(3_000):
        r = rng.random()
        if r < 0.35:
            n = rng.randint(1, 6)
            try:
                ids = pool.allocate(n)
            except NoFreeBlocksError:
                assert n > pool.num_free
                ops["nofree"] += 1
            else:
                ops["alloc"] += 1
                assert len(set(ids)) == n and all(refs[b] == 0 for b in ids)
                for b in ids:
                    refs[b] = 1
                    if rng.random() < 0.7:
                        k = rng.randrange(40)
                        if pool.publish(b, _h(k), _toks(k)):
                            hashed[_h(k)] = b
                live.append(ids)
        elif r < 0.65 and live:
            ids = live.pop(rng.randrange(len(live)))
            pool.release(ids)
            for b in ids:
                refs[b] -= 1
            ops["release"] += 1
        elif r < 0.85:
            ks = rng.sample(range(40), rng.randint(1, 3))  # distinct, as in a real chain
            got = pool.lookup_and_take([_h(k) for k in ks], [_toks(k) for k in ks])
            for b in got:
                refs[b] += 1
            if got:
                live.append(got)
                ops["take"] += 1
        elif r < 0.95 and live:
            ids = live[rng.randrange(len(live))]
            before = _snapshot(pool)
            with pytest.raises(ValueError):
                pool.release([*ids, ids[0]])
            assert _snapshot(pool) == before
            ops["double"] += 1
        elif r >= 0.995 and pool.num_blocks < 24:
            pool.grow(1)
            refs.append(0)
            ops["grow"] += 1
        pool.check_integrity()
        assert [pool.ref_count(b) for b in range(pool.num_blocks)] == refs
        assert pool.num_free == sum(1 for x in refs if x == 0)
        for h, b in pool._by_hash.items():
            assert pool.block_hash(b) == h
    assert all(v > 0 for v in ops.values()), ops
    for ids in live:
        pool.release(ids)
    assert pool.num_free == pool.num_blocks
    pool.check_integrity()


def test_integrity_catches_referenced_block_in_free_queue() -> None:
    pool = BlockPool(4, BS)
    [b, _] = pool.allocate(2)
    pool.check_integrity()
    pool._free[b] = None
    with pytest.raises(AssertionError, match="free queue"):
        pool.check_integrity()


def test_integrity_catches_lost_free_block() -> None:
    pool = BlockPool(4, BS)
    del pool._free[3]
    with pytest.raises(AssertionError, match="free queue"):
        pool.check_integrity()


def test_integrity_catches_hash_index_mismatch() -> None:
    pool = BlockPool(4, BS)
    a, b = pool.allocate(2)
    pool.publish(a, _h(0), _toks(0))
    pool.check_integrity()
    pool._by_hash[_h(1)] = b  # b holds no hash
    with pytest.raises(AssertionError, match="hash index points at block"):
        pool.check_integrity()


def test_integrity_catches_unindexed_hash() -> None:
    pool = BlockPool(4, BS)
    [a] = pool.allocate(1)
    pool.publish(a, _h(5), _toks(5))
    pool.check_integrity()
    del pool._by_hash[_h(5)]
    with pytest.raises(AssertionError, match="missing from the index"):
        pool.check_integrity()


# --- threads ---


def test_concurrent_requests_keep_integrity() -> None:
    num_threads, cycles, num_blocks = 4, 2_000, 64
    pool = BlockPool(num_blocks, BS)
    prompts = [[(p * 131 + i) % 97 for i in range(4 * BS)] for p in range(8)]
    # Prompts 0-3 share a first block so chains branch.
    for p in range(4):
        prompts[p][:BS] = prompts[0][:BS]
    chains = []
    for p in prompts:
        blocks = [p[s : s + BS] for s in range(0, len(p), BS)]
        chains.append((block_hashes(p, BS, FP), blocks))
    errors: list[BaseException] = []
    stats = {"hits": 0, "nofree": 0}
    stats_lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        live: list[list[int]] = []
        hits = nofree = 0
        try:
            for _ in range(cycles):
                if live and (len(live) >= 5 or rng.random() < 0.45):
                    pool.release(live.pop(rng.randrange(len(live))))
                    continue
                hashes, blocks = chains[rng.randrange(len(chains))]
                n = rng.randint(1, len(blocks))
                got = pool.lookup_and_take(hashes[:n], blocks[:n])
                hits += len(got)
                try:
                    new = pool.allocate(n - len(got) + rng.randint(0, 8))
                except NoFreeBlocksError:
                    nofree += 1
                    if got:
                        pool.release(got)
                    continue
                for i in range(len(got), n):
                    pool.publish(new[i - len(got)], hashes[i], blocks[i])
                live.append(got + new)
            for ids in live:
                pool.release(ids)
        except BaseException as e:  # reported by the main thread
            errors.append(e)
        with stats_lock:
            stats["hits"] += hits
            stats["nofree"] += nofree

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(num_threads)]
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often so operations interleave
    try:
        for t in threads:
            t.start()
        checks = 0
        while any(t.is_alive() for t in threads):
            pool.check_integrity()
            assert 0 <= pool.num_free <= num_blocks
            checks += 1
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert errors == []
    assert checks > 0
    assert stats["hits"] > 0  # the prefix index was exercised across threads
    pool.check_integrity()
    assert pool.num_free == pool.num_blocks == num_blocks
    assert all(pool.ref_count(b) == 0 for b in range(num_blocks))
    assert sorted(pool.allocate(num_blocks)) == list(range(num_blocks))
