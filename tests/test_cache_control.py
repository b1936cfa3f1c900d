"""ControlPlane: the rules the engine and the simulator share, held through a fake tier that records calls."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import pytest

from kvdiet.cache.control import CacheRequest, ControlPlane, Geometry, Loaded
from kvdiet.cache.counters import TierCounters
from kvdiet.cache.keys import IdKeys, KeyKind
from kvdiet.cache.plan import Replay, RestorePlan, RestoreWindow, WindowSource
from kvdiet.cache.policies import parse_policy

BS, W = 4, 8
GEO = Geometry(block_size=BS, window=W, num_layers=3, align=2, block_bytes=100, window_block_bytes=30)


class FakeTier:
    """A dict tier of sizes that records every key read and written."""

    def __init__(self, held: dict[Hashable, int] | None = None) -> None:
        self.held = dict(held or {})
        self.counters = TierCounters()
        self.reads: list[Hashable] = []
        self.writes: list[Hashable] = []

    def get_many(self, keys: Sequence[Hashable], tokens=None) -> list[int | None]:
        self.reads += keys
        return [self.held.get(k) for k in keys]

    def put_many(self, items) -> int:
        for k, _, v in items:
            self.writes.append(k)
            self.held[k] = v
        return len(items)

    def contains_prefix(self, keys: Sequence[Hashable]) -> int:
        return next((i for i, k in enumerate(keys) if k not in self.held), len(keys))

    def close(self) -> None:
        pass


def _control(policy: str, persistent: FakeTier | None = None, pool: FakeTier | None = None) -> ControlPlane:
    return ControlPlane(parse_policy(policy), GEO, IdKeys(), persistent=persistent, swa_pool=pool)


def _forward(c: ControlPlane, req: CacheRequest, start: int, end: int, snaps: list[int]) -> None:
    def snapshot(pos: int) -> int:
        snaps.append(pos)
        return 50

    c.after_forward(
        req, start, end, blocks=lambda i, j: [100] * (j - i), window_block=lambda i: 30, snapshot=snapshot
    )


@pytest.mark.parametrize(
    ("policy", "n", "points"),
    [
        ("bounded-replay", 10, [8]),  # (10 − 1) // 4 × 4 = 8 = 10 // 4 × 4
        ("bounded-replay", 12, [8, 12]),  # the prompt's last token sits in block 3: boundary 8; the end 12
        ("checkpoint:8", 20, [8, 16, 20]),
        ("exact-recompute", 3, []),  # no full block
    ],
)
def test_capture_points_are_the_prompts_boundaries_and_the_checkpoints(
    policy: str, n: int, points: list[int]
) -> None:
    assert _control(policy).capture_points(n) == points


def test_load_reads_the_indexed_run_and_stops_at_a_refusal() -> None:
    ids = list(range(10))
    ssd = FakeTier(dict.fromkeys((2, 3, 4, 5, 7), 100))  # a block's key is its id (IdKeys)
    c = _control("bounded-replay", ssd)
    req = CacheRequest(41, ids)
    assert c.load(req, 2, 10, lambda i, v: True) == Loaded(0, 4)  # 2..5; 6 is not indexed
    assert ssd.reads == [2, 3, 4, 5]
    taken: list[int] = []
    assert c.load(req, 2, 10, lambda i, v: len(taken) < 2 and not taken.append(i)) == Loaded(0, 2)
    assert taken == [2, 3]
    ssd.held[3] = 99  # a payload of the wrong size ends the run
    assert c.load(req, 2, 10, lambda i, v: True) == Loaded(0, 1)


def test_a_pool_snapshot_is_restored_else_bounded_replay_replays_the_last_window() -> None:
    pool = FakeTier({(KeyKind.POOL_SNAPSHOT, 4): 50})  # a snapshot at the end of block 4: position 20
    c = _control("bounded-replay", FakeTier(), pool)
    req = CacheRequest(30, list(range(7)))
    plan, window = c.plan(req, 5)
    assert plan == RestorePlan(20, 20, WindowSource.SWA_POOL, 20)
    assert window == RestoreWindow(20, WindowSource.SWA_POOL, ((KeyKind.POOL_SNAPSHOT, 4),), (50,))
    plan, window = c.plan(req, 5, use_stored=False)
    assert window == Replay(12, 20, clipped=True)  # 20 − 8, aligned to 2
    plan, window = c.plan(req, 2)  # H = 8 ≤ W: not adopted
    assert (plan.hit_tokens, window) == (0, None)


def test_full_store_reads_the_window_blocks_of_the_last_w_tokens_and_stops_at_a_gap() -> None:
    ssd = FakeTier({(KeyKind.WINDOW_BLOCK, i): 30 for i in (4, 5)})
    c = _control("full-store", ssd)
    req = CacheRequest(30, list(range(7)))
    plan, window = c.plan(req, 6)  # H = 24: blocks covering [16, 24) are 4 and 5
    assert isinstance(window, RestoreWindow) and window.payloads == (30, 30) and plan.replay_tokens == 0
    del ssd.held[(KeyKind.WINDOW_BLOCK, 4)]
    ssd.reads.clear()
    plan, window = c.plan(req, 6)
    assert ssd.reads == [(KeyKind.WINDOW_BLOCK, 4)]  # nothing past the first missing block
    assert window == Replay(2, 24, clipped=False)  # the exact dependency window: 24 − (8 + 2 × 7)


def test_boundary_snapshots_store_the_prompt_end_at_once_and_the_last_boundary_at_finish() -> None:
    ssd = FakeTier()
    c = _control("boundary-snapshot", ssd)
    req = CacheRequest(10, list(range(5)))
    c.admit(req, RestorePlan(0, None, None, 0), device_blocks=0, loaded=Loaded(0, 0))
    snaps: list[int] = []
    _forward(c, req, 0, 8, snaps)  # the prompt boundary (10 − 1) // 4 × 4 = 8: stored now
    assert snaps == [8] and ssd.writes[-1] == (KeyKind.SNAPSHOT, 1)
    assert ssd.writes[:2] == [0, 1]  # written through first
    _forward(c, req, 8, 10, snaps)
    _forward(c, req, 10, 17, snaps)  # decode past 12 and 16: the latest is held
    assert snaps == [8, 12, 16] and req.held == (16, 50)
    assert (KeyKind.SNAPSHOT, 3) not in ssd.held
    c.finish(req)
    c.finish(req)  # once
    assert ssd.writes.count((KeyKind.SNAPSHOT, 3)) == 1 and c.stats.snapshots_stored == 2
    assert not any(isinstance(k, tuple) and k[0] is KeyKind.WINDOW_BLOCK for k in ssd.writes)  # full-store's


def test_the_state_at_the_hit_is_captured_only_when_an_exact_recompute_rebuilt_it() -> None:
    for plan, stored in [
        (RestorePlan(8, 8, WindowSource.PERSISTENT, 8), []),  # restored: H is not reached again
        (RestorePlan(8, None, None, 2), [8]),  # exact recompute from 2: H rebuilt exactly
        (RestorePlan(8, None, None, 2, clipped=True), []),  # bounded replay: approximate, never stored
    ]:
        ssd = FakeTier()
        c = _control("boundary-snapshot", ssd)
        req = CacheRequest(10, list(range(5)))
        c.admit(req, plan, device_blocks=2, loaded=Loaded(0, 0))
        snaps: list[int] = []
        _forward(c, req, plan.replay_start, 10, snaps)
        assert snaps == stored, plan


def test_full_store_writes_each_blocks_window_entries_beside_its_kv() -> None:
    ssd = FakeTier()
    c = _control("full-store", ssd)
    req = CacheRequest(9, list(range(3)))
    c.admit(req, RestorePlan(0, None, None, 0), device_blocks=0, loaded=Loaded(0, 0))
    _forward(c, req, 0, 9, [])
    assert ssd.writes == [
        0,
        (KeyKind.WINDOW_BLOCK, 0),
        1,
        (KeyKind.WINDOW_BLOCK, 1),
    ]
    assert req.persisted == 2


def test_admit_counts_the_lookup_and_gives_the_provenance() -> None:
    ssd, pool = FakeTier(), FakeTier()
    c = _control("bounded-replay", ssd, pool)
    req = CacheRequest(30, list(range(7)))
    prov = c.admit(req, RestorePlan(20, None, None, 12, clipped=True), device_blocks=2, loaded=Loaded(0, 3))
    assert (prov.device_tokens, prov.persistent_tokens, prov.replayed_tokens, prov.computed_tokens) == (
        8,
        12,
        8,
        10,
    )
    assert prov.window_source is WindowSource.REPLAY and not prov.exact
    s = c.stats
    assert (s.device.query_tokens, s.device.hit_tokens) == (28, 8)  # usable = (30 − 1) // 4 = 7 blocks
    assert (s.persistent.query_tokens, s.persistent.hit_tokens) == (20, 12)
    assert (s.swa_pool.query_tokens, s.swa_pool.hit_tokens) == (8, 0)
    assert req.persisted == 5


def test_no_state_is_captured_within_the_receptive_field_of_a_bounded_replay() -> None:
    # W = 8, L = 3: the replay from 12 leaves approximate windows until 12 + 8 + 2 × 7 = 34
    for n, stored, held in [(30, [], None), (40, [36], 40)]:  # prompt boundaries 28 (tainted), 36 (exact)
        pool = FakeTier()
        c = _control("bounded-replay", FakeTier(), pool)
        req = CacheRequest(n, list(range(n // BS + 1)))
        c.admit(req, RestorePlan(20, None, None, 12, clipped=True), device_blocks=5, loaded=Loaded(0, 0))
        snaps: list[int] = []
        _forward(c, req, 12, n, snaps)
        assert snaps == stored + ([held] if held else []), n
        assert [k[1] for k in pool.writes] == [p // BS - 1 for p in stored]  # 40 waits for the finish
        assert (req.held[0] if req.held else None) == held


# --- the global pool: device → DRAM → disk ---


class LoggedTier(FakeTier):
    """A `FakeTier` that also appends ``(name, key)`` of every read to a log shared between tiers."""

    def __init__(self, name: str, log: list, held: dict[Hashable, int] | None = None) -> None:
        super().__init__(held)
        self.name, self.log = name, log

    def get_many(self, keys: Sequence[Hashable], tokens=None) -> list[int | None]:
        self.log += [(self.name, k) for k in keys]
        return super().get_many(keys, tokens)


def _tiers(glob: dict, disk: dict) -> tuple[ControlPlane, LoggedTier, LoggedTier, list]:
    log: list = []
    g, d = LoggedTier("dram", log, glob), LoggedTier("disk", log, disk)
    c = ControlPlane(parse_policy("bounded-replay"), GEO, IdKeys(), persistent=d, global_pool=g)
    return c, g, d, log


def test_load_reads_the_global_pool_first_and_the_persistent_tier_continues_its_run() -> None:
    c, g, d, log = _tiers(dict.fromkeys((2, 3, 6), 100), dict.fromkeys((2, 3, 4, 5, 7), 100))
    req = CacheRequest(41, list(range(10)))
    assert c.load(req, 2, 10, lambda i, v: True) == Loaded(2, 2)  # 2, 3 from DRAM; 4, 5 from disk; 6 not read
    assert log == [("dram", 2), ("dram", 3), ("disk", 4), ("disk", 5)]
    assert d.writes == [2, 3] and g.writes == [4, 5]  # DRAM hits kept on this disk; disk hits promoted
    log.clear()
    assert c.load(req, 0, 10, lambda i, v: True) == Loaded(0, 0)  # block 0 is nowhere: nothing read
    assert log == []


def test_a_bad_global_payload_falls_through_to_disk_and_a_refusal_stops_both() -> None:
    c, g, d, log = _tiers({2: 100, 3: 99, 4: 100}, dict.fromkeys((3, 4), 100))
    req = CacheRequest(41, list(range(10)))
    assert c.load(req, 2, 10, lambda i, v: True) == Loaded(1, 2)  # 3 has the wrong size in DRAM
    assert log == [("dram", 2), ("dram", 3), ("dram", 4), ("disk", 3), ("disk", 4)]
    assert d.writes == [2] and g.writes == [3, 4] and g.held[3] == 100  # the disk's good copy replaces it
    log.clear()
    taken: list[int] = []
    assert c.load(req, 2, 10, lambda i, v: len(taken) < 1 and not taken.append(i)) == Loaded(1, 0)
    assert ("disk", 3) not in log  # the device pool is full: the disk is not read


def test_admit_counts_each_tier_and_provenance_splits_the_hit() -> None:
    c, *_ = _tiers({}, {})
    req = CacheRequest(41, list(range(10)))
    prov = c.admit(req, RestorePlan(32, None, None, 24, clipped=True), device_blocks=2, loaded=Loaded(3, 3))
    assert (prov.device_tokens, prov.global_pool_tokens, prov.persistent_tokens) == (8, 12, 12)
    assert prov.hit_tokens == 32 and prov.as_dict()["hit_tokens"] == 32
    s = c.stats
    assert (s.device.query_tokens, s.device.hit_tokens) == (40, 8)
    assert (s.global_pool.query_tokens, s.global_pool.hit_tokens) == (32, 12)
    assert (s.persistent.query_tokens, s.persistent.hit_tokens) == (20, 12)
    assert s.as_dict()["global_pool"]["hit_tokens"] == 12
    short = c.admit(req, RestorePlan(12, None, None, 4, clipped=True), device_blocks=1, loaded=Loaded(3, 3))
    assert (short.device_tokens, short.global_pool_tokens, short.persistent_tokens) == (4, 8, 0)


def test_blocks_are_written_through_to_both_tiers_global_kv_only_in_dram() -> None:
    g, d = FakeTier(), FakeTier()
    c = ControlPlane(parse_policy("full-store"), GEO, IdKeys(), persistent=d, global_pool=g)
    req = CacheRequest(13, list(range(3)))
    c.admit(req, RestorePlan(0, None, None, 0), device_blocks=0, loaded=Loaded(0, 0))
    _forward(c, req, 0, 12, [])
    assert g.writes == [0, 1, 2]
    assert d.writes == [
        0,
        (KeyKind.WINDOW_BLOCK, 0),
        1,
        (KeyKind.WINDOW_BLOCK, 1),
        2,
        (KeyKind.WINDOW_BLOCK, 2),
    ]
    _forward(c, req, 12, 13, [])
    assert g.writes == [0, 1, 2]  # nothing new filled
