"""InProcessSwaPool: fixed TTL (case B23), LRU byte budget, counters, sweep, default size, thread safety."""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Callable

import pytest

from kvdiet.storage.clock import ManualClock
from kvdiet.storage.swa_pool import DEFAULT_SWA_POOL_TTL_S, InProcessSwaPool, default_swa_pool_bytes

Reader = Callable[[InProcessSwaPool, bytes], "bytes | None"]


def _get(pool: InProcessSwaPool, key: bytes) -> bytes | None:
    return pool.get(key)


def _get_many(pool: InProcessSwaPool, key: bytes) -> bytes | None:
    # The key between two absent ones, so get_many's per-key handling is exercised.
    out = pool.get_many([b"absent-1", key, b"absent-2"])
    assert out[0] is None and out[2] is None
    return out[1]


READERS = pytest.mark.parametrize("read", [_get, _get_many], ids=["get", "get_many"])


def _pool(capacity: int = 1_000, ttl: float = 5.0) -> tuple[InProcessSwaPool, ManualClock]:
    clock = ManualClock()
    return InProcessSwaPool(capacity, ttl_s=ttl, clock=clock), clock


def test_rejects_bad_arguments() -> None:
    for cap, ttl in [(0, 5.0), (-1, 5.0), (10, 0.0), (10, -1.0)]:
        with pytest.raises(ValueError, match="capacity > 0 and ttl > 0"):
            InProcessSwaPool(cap, ttl_s=ttl, clock=ManualClock())


def test_defaults() -> None:
    pool = InProcessSwaPool(clock=ManualClock())
    assert pool.ttl_s == DEFAULT_SWA_POOL_TTL_S == 300.0
    assert pool.capacity_bytes == default_swa_pool_bytes()


# --- TTL (case B23) ---


@READERS
def test_ttl_fixed_and_exclusive_b23(read: Reader) -> None:
    pool, clock = _pool(ttl=5.0)
    assert pool.put(b"k", b"snapshot") is True
    clock.set(4.0)
    assert read(pool, b"k") == b"snapshot"  # a read at 4 ...
    clock.set(4.9)
    assert read(pool, b"k") == b"snapshot"
    assert pool.counters.expirations == 0
    clock.set(5.0)
    assert read(pool, b"k") is None  # ... did not move the deadline: a miss at exactly t0 + ttl
    assert pool.counters.expirations == 1
    assert len(pool) == 0 and pool.nbytes == 0


@READERS
def test_read_after_deadline_does_not_revive_b23(read: Reader) -> None:
    pool, clock = _pool(ttl=5.0)
    pool.put(b"k", b"snapshot")
    clock.set(4.0)
    assert read(pool, b"k") == b"snapshot"
    clock.set(6.0)
    assert read(pool, b"k") is None
    assert pool.counters.expirations == 1
    clock.set(6.5)
    assert read(pool, b"k") is None  # still a miss; expired once, counted once
    clock.set(100.0)
    assert read(pool, b"k") is None
    assert pool.counters.expirations == 1
    assert pool.counters.hits == 1
    assert len(pool) == 0 and pool.nbytes == 0


def test_get_many_mixed_deadlines() -> None:
    pool, clock = _pool(ttl=5.0)
    pool.put(b"a", b"A")
    clock.set(2.0)
    pool.put(b"b", b"BB")
    clock.set(5.0)  # a's deadline (5.0) reached, b's (7.0) not
    assert pool.get_many([b"a", b"b", b"c", b"b"]) == [None, b"BB", None, b"BB"]
    c = pool.counters
    assert (c.lookups, c.hits, c.expirations, c.bytes_read) == (4, 2, 1, 4)
    clock.set(6.999)
    assert pool.get(b"b") == b"BB"
    clock.set(7.0)
    assert pool.get(b"b") is None
    assert pool.counters.expirations == 2


def test_reput_restarts_the_ttl() -> None:
    pool, clock = _pool(ttl=5.0)
    pool.put(b"k", b"old")
    clock.set(3.0)
    pool.put(b"k", b"new")  # a new value, a new deadline at 8
    clock.set(6.0)
    assert pool.get(b"k") == b"new"
    clock.set(8.0)
    assert pool.get(b"k") is None


def test_sweep() -> None:
    pool, clock = _pool(ttl=5.0)
    pool.put(b"a", b"1" * 10)
    clock.set(1.0)
    pool.put(b"b", b"2" * 20)
    clock.set(3.0)
    pool.put(b"c", b"3" * 30)
    assert pool.sweep() == 0
    clock.set(6.0)  # a (5) and b (6) expired, c (8) not
    assert pool.sweep() == 2
    assert pool.counters.expirations == 2
    assert len(pool) == 1 and pool.nbytes == 30
    assert pool.get(b"c") == b"3" * 30
    assert pool.sweep() == 0
    clock.set(8.0)
    assert pool.sweep() == 1
    assert len(pool) == 0 and pool.nbytes == 0
    assert pool.counters.expirations == 3
    assert pool.counters.evictions == 0


# --- LRU byte budget ---


def test_lru_eviction_by_bytes() -> None:
    pool, _ = _pool(capacity=100)
    for k in (b"a", b"b", b"c"):
        assert pool.put(k, k * 30)
    assert pool.nbytes == 90 and len(pool) == 3
    assert pool.put(b"d", b"d" * 30)  # needs 20 more bytes: evicts a, the least recently used
    assert pool.get(b"a") is None
    assert [pool.get(k) for k in (b"b", b"c", b"d")] == [b"b" * 30, b"c" * 30, b"d" * 30]
    assert pool.counters.evictions == 1
    assert pool.counters.expirations == 0
    assert pool.nbytes == 90


def test_read_refreshes_lru_order() -> None:
    pool, _ = _pool(capacity=100)
    for k in (b"a", b"b", b"c"):
        pool.put(k, k * 30)
    assert pool.get(b"a") == b"a" * 30  # a is now the most recently used
    assert pool.get_many([b"b"]) == [b"b" * 30]  # then b
    pool.put(b"d", b"d" * 30)
    assert pool.get(b"c") is None
    assert pool.get(b"a") == b"a" * 30 and pool.get(b"b") == b"b" * 30
    assert pool.counters.evictions == 1


def test_eviction_of_several_entries() -> None:
    pool, _ = _pool(capacity=100)
    for k in (b"a", b"b", b"c", b"d", b"e"):
        pool.put(k, k * 20)
    assert pool.nbytes == 100
    assert pool.put(b"big", b"x" * 55)  # frees 55 bytes: a, b and c go
    assert [pool.get(k) is None for k in (b"a", b"b", b"c", b"d", b"e")] == [True, True, True, False, False]
    assert pool.counters.evictions == 3
    assert pool.nbytes == 95 and len(pool) == 3


def test_value_exactly_capacity_fits() -> None:
    pool, _ = _pool(capacity=100)
    pool.put(b"a", b"a" * 10)
    assert pool.put(b"full", b"f" * 100)
    assert pool.get(b"a") is None and pool.get(b"full") == b"f" * 100
    assert pool.nbytes == 100 and pool.counters.evictions == 1


def test_value_bigger_than_capacity_is_refused() -> None:
    pool, _ = _pool(capacity=100)
    pool.put(b"a", b"a" * 40)
    pool.put(b"b", b"b" * 40)
    before = pool.counters.as_dict()
    assert pool.put(b"huge", b"h" * 101) is False
    assert pool.put(b"a", b"h" * 101) is False  # refused even for an existing key: the old value stays
    assert pool.counters.as_dict() == before  # nothing evicted, nothing written
    assert pool.get(b"a") == b"a" * 40 and pool.get(b"b") == b"b" * 40
    assert pool.get(b"huge") is None
    assert pool.nbytes == 80 and len(pool) == 2


def test_reput_replaces_and_keeps_nbytes() -> None:
    pool, _ = _pool(capacity=100)
    pool.put(b"a", b"a" * 30)
    pool.put(b"b", b"b" * 30)
    assert pool.put(b"a", b"A" * 50)
    assert pool.nbytes == 80 and len(pool) == 2
    assert pool.get(b"a") == b"A" * 50
    assert pool.put(b"a", b"z" * 5)
    assert pool.nbytes == 35
    assert pool.counters.evictions == 0
    # The old value of a key does not count against its new one: 30 + 70 fits exactly.
    assert pool.put(b"a", b"y" * 70)
    assert pool.nbytes == 100 and pool.get(b"b") == b"b" * 30
    assert pool.counters.evictions == 0
    assert pool.counters.entries_written == 5
    assert pool.counters.bytes_written == 30 + 30 + 50 + 5 + 70


def test_stored_value_is_a_copy() -> None:
    pool, _ = _pool()
    buf = bytearray(b"abc")
    pool.put(b"k", buf)
    buf[0] = ord("X")
    assert pool.get(b"k") == b"abc"
    assert type(pool.get(b"k")) is bytes


def test_counters() -> None:
    pool, _ = _pool(capacity=100)
    pool.put(b"a", b"1234")
    pool.put(b"b", b"12345678")
    pool.get(b"a")
    pool.get(b"zz")
    pool.get_many([b"a", b"b", b"q"])
    c = pool.counters
    assert (c.entries_written, c.bytes_written) == (2, 12)
    assert (c.lookups, c.hits, c.bytes_read) == (5, 3, 16)


def test_close_drops_everything() -> None:
    pool, _ = _pool()
    pool.put(b"a", b"12")
    pool.close()
    assert len(pool) == 0 and pool.nbytes == 0 and pool.get(b"a") is None


# --- default size ---


def test_default_size_is_ten_percent_of_ram() -> None:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    mem_total = int(fields["MemTotal"].split()[0]) * 1024
    got = default_swa_pool_bytes()
    assert abs(got - mem_total / 10) <= 0.01 * mem_total / 10


# --- threads ---


def test_threads_keep_nbytes_consistent() -> None:
    clock = ManualClock()
    pool = InProcessSwaPool(3_000, ttl_s=0.2, clock=clock)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(3_000):
                key = b"k%d" % rng.randrange(40)
                r = rng.random()
                if r < 0.45:
                    assert pool.put(key, bytes([seed]) * rng.randint(1, 200))
                elif r < 0.75:
                    v = pool.get(key)
                    assert v is None or 1 <= len(v) <= 200
                elif r < 0.9:
                    pool.get_many([key, b"k%d" % rng.randrange(40)])
                elif r < 0.97:
                    clock.advance(rng.random() * 0.1)
                else:
                    pool.sweep()
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often so operations interleave
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert errors == []
    held = sum(len(v) for v, _ in pool._entries.values())
    assert pool.nbytes == held
    assert pool.nbytes <= pool.capacity_bytes
    c = pool.counters
    assert c.evictions > 0 and c.expirations > 0 and c.hits > 0
    assert c.hits <= c.lookups
    assert c.entries_written - c.evictions - c.expirations >= len(pool)
