"""SwaPolicy.plan: the restore plan of every SWA policy around the window, block and checkpoint edges."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterable

import pytest

from kvdiet.cache.plan import RestorePlan, WindowSource, exact_recompute_start
from kvdiet.cache.policies import SwaPolicy, parse_policy

COLD = RestorePlan(0, None, None, 0)


class Store:
    """``has_snapshot`` over a set of positions (or all of them), recording every position asked about."""

    def __init__(self, positions: Iterable[int] | Callable[[int], bool]) -> None:
        self._has = positions if callable(positions) else set(positions).__contains__
        self.calls: list[int] = []

    def __call__(self, pos: int) -> bool:
        self.calls.append(pos)
        return self._has(pos)


def _plan(
    policy: str, h: int, store: Store, *, window: int = 8, layers: int = 3, align: int = 4
) -> RestorePlan:
    return parse_policy(policy).plan(h, window=window, num_layers=layers, align=align, has_snapshot=store)


def _tuple(p: RestorePlan) -> tuple:
    return (p.hit_tokens, p.snapshot_at, p.snapshot_source, p.replay_start, p.replay_tokens, p.clipped)


# --- exact_recompute_start ---


@pytest.mark.parametrize(
    ("h", "w", "layers", "align", "start"),
    [
        (100, 8, 3, 4, 76),  # 100 − (8 + 2·7) = 78 → 76
        (100, 8, 3, 1, 78),
        (26, 8, 3, 4, 4),
        (25, 8, 3, 4, 0),  # 3 → 0
        (22, 8, 3, 4, 0),
        (10, 8, 3, 4, 0),  # clamped at 0
        (0, 8, 3, 4, 0),
        (20, 8, 1, 4, 12),  # one layer: H − W
        (20, 8, 1, 1, 12),
        (1024, 128, 4, 128, 512),  # 1024 − 509 = 515 → 512
        (10_000, 128, 40, 128, 4_864),  # V4.1-flash-sized: 10000 − 5081 = 4919 → 4864
        (509, 128, 4, 128, 0),
        (510, 128, 4, 1, 1),
    ],
)
def test_exact_recompute_start(h: int, w: int, layers: int, align: int, start: int) -> None:
    assert exact_recompute_start(h, w, layers, align) == start


def test_restore_plan() -> None:
    p = RestorePlan(40, None, None, 28, clipped=True)
    assert p.replay_tokens == 12
    assert RestorePlan(40, 40, WindowSource("persistent"), 40).replay_tokens == 0
    assert RestorePlan(40, 40, WindowSource("persistent"), 40).clipped is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.hit_tokens = 0  # type: ignore[misc]


# --- hand-checked plans (W = 8, L = 3 → receptive field 22, align = 4, block size 4) ---

# (policy, H, stored positions, expected (hit, snapshot_at, source, replay_start, replay_tokens, clipped),
#  positions has_snapshot may be asked about)
HAND = [
    # bounded-replay
    ("bounded-replay", 0, {0}, (0, None, None, 0, 0, False), []),
    ("bounded-replay", 4, {4}, (4, 4, "swa-pool", 4, 0, False), [4]),
    ("bounded-replay", 4, set(), (0, None, None, 0, 0, False), [4]),
    ("bounded-replay", 6, set(), (0, None, None, 0, 0, False), [6]),  # W − 2
    ("bounded-replay", 7, {7}, (7, 7, "swa-pool", 7, 0, False), [7]),  # W − 1
    ("bounded-replay", 8, set(), (0, None, None, 0, 0, False), [8]),  # H = W: not adopted
    ("bounded-replay", 8, {8}, (8, 8, "swa-pool", 8, 0, False), [8]),
    ("bounded-replay", 12, set(), (12, None, None, 4, 8, True), [12]),
    ("bounded-replay", 12, {4, 8}, (12, None, None, 4, 8, True), [12]),  # other positions are not used
    ("bounded-replay", 13, set(), (13, None, None, 4, 9, True), [13]),  # 5 → 4
    ("bounded-replay", 16, set(), (16, None, None, 8, 8, True), [16]),
    ("bounded-replay", 16, {16}, (16, 16, "swa-pool", 16, 0, False), [16]),
    ("bounded-replay", 100, set(), (100, None, None, 92, 8, True), [100]),
    # boundary-snapshot
    ("boundary-snapshot", 0, {0}, (0, None, None, 0, 0, False), []),
    ("boundary-snapshot", 4, {4}, (4, 4, "persistent", 4, 0, False), [4]),
    ("boundary-snapshot", 8, set(), (0, None, None, 0, 0, False), [8]),
    ("boundary-snapshot", 24, set(), (0, None, None, 0, 0, False), [24]),  # 2 → 0: cold
    ("boundary-snapshot", 26, set(), (26, None, None, 4, 22, False), [26]),
    ("boundary-snapshot", 32, {24, 28}, (32, None, None, 8, 24, False), [32]),
    ("boundary-snapshot", 32, {32}, (32, 32, "persistent", 32, 0, False), [32]),
    # full-store
    ("full-store", 8, {8}, (8, 8, "window-blocks", 8, 0, False), [8]),
    ("full-store", 12, set(), (0, None, None, 0, 0, False), [12]),
    ("full-store", 40, set(), (40, None, None, 16, 24, False), [40]),  # 18 → 16
    ("full-store", 40, {40}, (40, 40, "window-blocks", 40, 0, False), [40]),
    # checkpoint:8
    ("checkpoint:8", 0, {0}, (0, None, None, 0, 0, False), []),
    ("checkpoint:8", 4, {0, 4}, (0, None, None, 0, 0, False), []),  # C = 0: nothing to ask
    ("checkpoint:8", 7, {7}, (0, None, None, 0, 0, False), []),
    ("checkpoint:8", 8, {8}, (8, 8, "persistent", 8, 0, False), [8]),
    ("checkpoint:8", 9, {8}, (9, 8, "persistent", 8, 1, False), [8]),
    ("checkpoint:8", 15, {8}, (15, 8, "persistent", 8, 7, False), [8]),
    ("checkpoint:8", 16, {8}, (0, None, None, 0, 0, False), [16]),  # only the latest checkpoint counts
    ("checkpoint:8", 28, {24}, (28, 24, "persistent", 24, 4, False), [24]),
    ("checkpoint:8", 28, {28}, (28, None, None, 4, 24, False), [24]),
    ("checkpoint:8", 31, set(), (31, None, None, 8, 23, False), [24]),  # 9 → 8
    # K longer than the receptive field (22): the exact start E wins when it is at or past C
    ("checkpoint:32", 50, {32}, (50, 32, "persistent", 32, 18, False), [32]),  # E = 28 < C = 32
    ("checkpoint:32", 54, {32}, (54, None, None, 32, 22, False), []),  # E = 32 = C: no snapshot read
    ("checkpoint:32", 60, {32}, (60, None, None, 36, 24, False), []),  # E = 38 → 36 > C = 32
    # exact-recompute
    ("exact-recompute", 0, set(), (0, None, None, 0, 0, False), []),
    ("exact-recompute", 8, {8}, (0, None, None, 0, 0, False), []),
    ("exact-recompute", 22, {22}, (0, None, None, 0, 0, False), []),
    ("exact-recompute", 25, {25}, (0, None, None, 0, 0, False), []),
    ("exact-recompute", 26, {26}, (26, None, None, 4, 22, False), []),
    ("exact-recompute", 100, {100}, (100, None, None, 76, 24, False), []),
]


@pytest.mark.parametrize(("policy", "h", "stored", "want", "calls"), HAND)
def test_hand_checked_plans(policy: str, h: int, stored: set[int], want: tuple, calls: list[int]) -> None:
    store = Store(stored)
    assert _tuple(_plan(policy, h, store)) == want
    assert store.calls == calls


# --- sweep against the documented rules ---


def _align_down(x: int, align: int) -> int:
    return x - x % align


def _expected(policy: SwaPolicy, h: int, w: int, layers: int, align: int, has: Callable[[int], bool]):
    """The module docstring's rules, written independently: (plan, positions asked)."""
    if h <= 0:
        return COLD, []
    if policy.name == "bounded-replay":
        if has(h):
            return RestorePlan(h, h, WindowSource("swa-pool"), h), [h]
        start = _align_down(h - w, align) if h > w else 0
        # "a plan whose recompute would start at 0 adopts nothing"
        return (COLD if start == 0 else RestorePlan(h, None, None, start, clipped=True)), [h]
    calls: list[int] = []
    if policy.name in ("boundary-snapshot", "full-store"):
        calls = [h]
        if has(h):
            source = "window-blocks" if policy.name == "full-store" else "persistent"
            return RestorePlan(h, h, WindowSource(source), h), calls
    start = _align_down(max(0, h - (w + (layers - 1) * (w - 1))), align)
    if policy.name == "checkpoint":
        k = policy.checkpoint_every
        c = (h // k) * k
        if c > start:  # "replay from the later of the two starts"
            calls = [c]
            if has(c):
                return RestorePlan(h, c, WindowSource("persistent"), c), calls
    return (COLD if start == 0 else RestorePlan(h, None, None, start)), calls


# (W, L, align, block size, checkpoint periods)
GEOMETRIES = [
    (8, 3, 4, 4, (8, 12)),
    (8, 3, 2, 8, (8, 16)),
    (6, 2, 1, 2, (4, 6)),
    (128, 4, 128, 128, (256, 384)),
    (16, 1, 4, 16, (16,)),
]


def _positions(w: int, layers: int, bs: int, periods: tuple[int, ...]) -> list[int]:
    field = w + (layers - 1) * (w - 1)
    hs = set(range(w - 2, w + 3)) | set(range(field - 2, field + 3))
    for k in range(0, (field + 3 * bs) // bs + 2):
        hs |= {k * bs - 1, k * bs, k * bs + 1}
    for p in periods:
        for k in range(0, 5):
            hs |= {k * p - 1, k * p, k * p + 1}
    return sorted(h for h in hs if h >= 0)


def _stores(seed: int) -> list[tuple[str, Callable[[int], bool]]]:
    rng = random.Random(seed)
    table: dict[int, bool] = {}

    def some(pos: int) -> bool:
        if pos not in table:
            table[pos] = rng.random() < 0.5
        return table[pos]

    return [("all", lambda pos: True), ("none", lambda pos: False), ("some", some)]


@pytest.mark.parametrize(("w", "layers", "align", "bs", "periods"), GEOMETRIES)
def test_sweep_matches_documented_rules(
    w: int, layers: int, align: int, bs: int, periods: tuple[int, ...]
) -> None:
    policies = [parse_policy(p) for p in ("bounded-replay", "boundary-snapshot", "full-store")]
    policies += [parse_policy(f"checkpoint:{k}") for k in periods]
    policies.append(parse_policy("exact-recompute"))
    checked = 0
    for store_name, has in _stores(seed=w * 1000 + align):
        for policy in policies:
            for h in _positions(w, layers, bs, periods):
                want, want_calls = _expected(policy, h, w, layers, align, has)
                store = Store(has)
                got = policy.plan(h, window=w, num_layers=layers, align=align, has_snapshot=store)
                where = f"{policy} H={h} W={w} L={layers} align={align} store={store_name}"
                assert got == want, where
                assert store.calls == want_calls, where
                # Invariants of every plan.
                assert 0 <= got.replay_start <= got.hit_tokens <= h, where
                assert (got.snapshot_at is None) == (got.snapshot_source is None), where
                if got.snapshot_at is None:
                    assert got.replay_start % align == 0, where
                else:
                    assert got.replay_start == got.snapshot_at, where
                if got.hit_tokens == 0:
                    assert got == COLD, where
                if policy.exact:
                    assert got.clipped is False, where
                checked += 1
    assert checked > 200


def test_sweep_exercises_every_outcome() -> None:
    """The sweep above reaches each kind of plan for each policy (so it cannot pass vacuously)."""
    seen: set[tuple[str, str]] = set()
    for w, layers, align, bs, periods in GEOMETRIES:
        names = ["bounded-replay", "boundary-snapshot", "full-store", f"checkpoint:{periods[0]}"]
        for name in [*names, "exact-recompute"]:
            policy = parse_policy(name)
            for _, has in _stores(seed=0):
                for h in _positions(w, layers, bs, periods):
                    p = policy.plan(h, window=w, num_layers=layers, align=align, has_snapshot=has)
                    kind = (
                        "cold" if p.hit_tokens == 0 else "snapshot" if p.snapshot_at is not None else "replay"
                    )
                    seen.add((policy.name, kind))
    for name in ("bounded-replay", "boundary-snapshot", "full-store", "checkpoint"):
        assert {(name, k) for k in ("cold", "snapshot", "replay")} <= seen
    assert {("exact-recompute", "cold"), ("exact-recompute", "replay")} <= seen
    assert ("exact-recompute", "snapshot") not in seen


def test_bounded_replay_reads_pool_only_at_h() -> None:
    store = Store(lambda pos: True)
    for h in (1, 7, 8, 9, 64, 1000):
        store.calls.clear()
        _plan("bounded-replay", h, store)
        assert store.calls == [h]


def test_exact_recompute_never_asks() -> None:
    store = Store(lambda pos: True)
    for h in range(0, 200, 3):
        _plan("exact-recompute", h, store)
    assert store.calls == []


# --- known bug ---


# A replay start that aligns down to 0 adopts nothing: a cold prefill costs the same.
@pytest.mark.parametrize(("h", "w", "align"), [(9, 8, 4), (130, 128, 128)])
def test_bounded_replay_replay_from_zero_is_cold(h: int, w: int, align: int) -> None:
    store = Store(set())
    plan = _plan("bounded-replay", h, store, window=w, align=align)
    assert plan == COLD
    assert store.calls == [h]
