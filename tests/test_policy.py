"""SWA policy parsing and the bytes/tokens each costs (DESIGN.md §5)."""

from __future__ import annotations

import random

import pytest

from kvdiet.cache.policies import Checkpoint, parse_policy
from kvdiet.cache.spec import CacheSpec
from kvdiet.config import load_config


@pytest.fixture(scope="module")
def spec() -> CacheSpec:
    return CacheSpec.from_config(load_config("deepseek-v4.1-flash"))


def test_parse() -> None:
    assert parse_policy("checkpoint:4096") == Checkpoint(4096)
    assert str(parse_policy("checkpoint:64")) == "checkpoint:64"
    assert parse_policy("bounded-replay").exact is False
    assert parse_policy("full-store").exact is True
    for bad, needle in [
        ("lru", "unknown SWA policy"),
        ("checkpoint", "needs a period"),
        ("checkpoint:0", "needs a period"),
        ("checkpoint:-4", "needs a period"),
        ("full-store:3", "takes no argument"),
    ]:
        with pytest.raises(ValueError, match=needle):
            parse_policy(bad)


def test_persistent_bytes(spec: CacheSpec) -> None:
    """A persisted snapshot counts what the engine writes (`CacheSpec.snapshot_bytes`): V4.1-Flash's rings
    (2,703,360 B) with their int64 positions (40 × 128 × 8), its three ratio-2 tails (two u32 counts each, plus
    the open row at an odd position: 2 × 512 × 4 B), 3 Engram ids and the 16-byte frame."""
    n = 10_000
    glob = spec.global_bytes(n)
    even = 2_703_360 + 40 * 128 * 8 + 3 * 8 + 3 * 8 + 16
    assert spec.snapshot_bytes(4096) == spec.snapshot_bytes(1000) == even == 2_744_384
    assert spec.snapshot_bytes(1001) == even + 3 * 2 * 512 * 4
    ends = (1000, 1001, 4096)
    assert parse_policy("bounded-replay").persistent_bytes(spec, n, boundaries=ends) == glob
    assert parse_policy("exact-recompute").persistent_bytes(spec, n, boundaries=ends) == glob
    snaps = 3 * even + 3 * 2 * 512 * 4  # each end at its own position
    assert parse_policy("boundary-snapshot").persistent_bytes(spec, n, boundaries=ends) == glob + snaps
    assert parse_policy("full-store").persistent_bytes(spec, n, boundaries=ends) == glob + n * 40 * 528
    assert parse_policy("checkpoint:4096").persistent_bytes(spec, n, boundaries=ends) == glob + 2 * even
    four_095 = parse_policy("checkpoint:4095")  # at 4095 (odd: the open rows) and 8190
    assert four_095.persistent_bytes(spec, n, boundaries=ends) == glob + 2 * even + 3 * 2 * 512 * 4


def test_snapshot_sums_over_a_range_equal_the_term_by_term_sum() -> None:
    """`CacheSpec.snapshots_bytes` sums a range over one cycle of residues: the same as snapshot by snapshot,
    for strides sharing any factor with V4-Flash's 128-token period, offsets, partial cycles and lists."""
    v4 = CacheSpec.from_config(load_config("deepseek-v4-flash"))
    for positions in (range(1, 1000), range(64, 5000, 64), range(7, 3001, 13), range(1024, 65537, 1024)):
        assert v4.snapshots_bytes(positions) == sum(map(v4.snapshot_bytes, positions)), positions
    assert v4.snapshots_bytes(range(0, 300, 100)) == sum(map(v4.snapshot_bytes, (0, 100, 200)))
    assert v4.snapshots_bytes([128, 64, 64]) == v4.snapshot_bytes(128) + 2 * v4.snapshot_bytes(64)
    assert v4.snapshots_bytes(range(0)) == 0
    big = range(1, 10**9 + 1)  # checkpoint:1 over a billion tokens, summed without a billion calls
    cycle, rest = sum(map(v4.snapshot_bytes, range(1, 129))), range(1, 10**9 % 128 + 1)
    assert v4.snapshots_bytes(big) == (10**9 // 128) * cycle + sum(map(v4.snapshot_bytes, rest))


def test_recompute_tokens(spec: CacheSpec) -> None:
    assert parse_policy("bounded-replay").recompute_tokens(spec, 10_000) == 128
    assert parse_policy("bounded-replay").recompute_tokens(spec, 50) == 50  # clamped at the hit
    assert parse_policy("exact-recompute").recompute_tokens(spec, 10_000) == 128 + 39 * 127
    assert parse_policy("checkpoint:256").recompute_tokens(spec, 10_000) == 255
    assert parse_policy("checkpoint:8192").recompute_tokens(spec, 10_000) == 5_081  # never past exact
    assert parse_policy("full-store").recompute_tokens(spec, 10_000) == 0


@pytest.mark.parametrize(
    "name",
    [
        "bounded-replay",
        "boundary-snapshot",
        "full-store",
        "exact-recompute",
        "checkpoint:96",
        "checkpoint:64",
    ],
)
def test_capture_candidates_are_exactly_the_boundaries_capture_at_answers(name: str) -> None:
    """A forward's end checks only `capture_candidates`: every block boundary where `capture_at` answers
    must be among them, and each of them must be a block boundary in the range."""
    policy, rng = parse_policy(name), random.Random(name)
    for _ in range(300):
        bs = rng.choice([16, 32, 64])
        lo = rng.randint(0, 40) * bs
        hi = lo + rng.randint(0, 60) * bs + rng.randint(0, bs - 1)
        boundary = rng.randint(0, 80) * bs
        answers = [
            p for p in range(lo, hi + 1, bs) if policy.capture_at(p, prompt_boundary=boundary) is not None
        ]
        candidates = list(policy.capture_candidates(lo, hi, block_size=bs, prompt_boundary=boundary))
        assert set(answers) <= set(candidates), (bs, lo, hi, boundary)
        assert all(lo <= p <= hi and p % bs == 0 for p in candidates)
        assert candidates == sorted(candidates)
