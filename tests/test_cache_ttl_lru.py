"""TtlLru: a batch written at once (`put_many`'s fast path for new keys that fit) leaves exactly what one `put`
after another leaves — entries, LRU order, counters, peaks by kind, byte-seconds — on random workloads."""

from __future__ import annotations

import random
from operator import itemgetter

import pytest

from kvdiet.cache.ttl_lru import TtlLru


def _state(t: TtlLru) -> tuple:
    return (
        t.values(),
        t.nbytes,
        t.peak,
        t.peak_kinds,
        t.kind_peak,
        t.kind_written,
        t.kind_bytes,
        round(t.byte_seconds, 6),
        {k: round(v, 6) for k, v in t.kind_byte_seconds.items()},
        t.counters,
    )


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(
    ("capacity", "ttl", "refresh"),
    [(None, 30.0, False), (600, 10.0, True), (900, None, False), (90, 10.0, False)],
)
def test_a_batch_equals_one_put_after_another(
    seed: int, capacity: int | None, ttl: float | None, refresh: bool
) -> None:
    rng = random.Random(seed)
    batched = TtlLru(capacity, ttl, refresh=refresh, kind=itemgetter(0))
    single = TtlLru(capacity, ttl, refresh=refresh, kind=itemgetter(0))
    now = 0.0
    for _ in range(300):
        now += rng.choice([0.0, 0.5, 2.0, 7.0])
        n = rng.randint(0, 6)
        keys = [(rng.choice("ab"), rng.randrange(40)) for _ in range(n)]
        if rng.random() < 0.7:  # mostly new keys, as blocks written through are
            keys = [(k, 1000 + rng.randrange(10**6)) for k, _ in keys]
        sizes = [rng.choice([10, 40, 100]) for _ in keys]
        stored = batched.put_many(keys, [f"v{s}" for s in sizes], sizes, now)
        assert stored == sum(single.put(k, f"v{s}", s, now) for k, s in zip(keys, sizes, strict=True))
        if rng.random() < 0.3:
            probe = [(rng.choice("ab"), rng.randrange(40)) for _ in range(3)]
            assert batched.get_many(probe, now) == [single.get(k, now) for k in probe]
        batched.expire(now)  # accrue both to now (an empty batch still runs the expiry pass)
        single.expire(now)
        assert _state(batched) == _state(single)
    batched.expire(now + 100)
    single.expire(now + 100)
    assert _state(batched) == _state(single)


def test_the_peak_of_a_batch_is_its_end_and_held_prefix_stops_at_the_first_miss() -> None:
    t = TtlLru(None, 10.0, refresh=False, kind=itemgetter(0))
    t.put_many([("kv", 1), ("win", 1), ("kv", 2)], [0, 0, 0], [100, 30, 100], 0.0)
    assert (t.peak, t.kind_peak, t.peak_kinds) == (230, {"kv": 200, "win": 30}, {"kv": 200, "win": 30})
    t.put_many([("kv", 3)], [0], [50], 5.0)
    assert t.held_prefix([("kv", 1), ("kv", 2), ("kv", 9), ("kv", 3)], 9.0) == 2
    assert t.held_prefix([("kv", 1), ("kv", 3)], 10.0) == 0  # the first batch expired at 10 s
    assert t.peak == 280 and t.nbytes == 50
