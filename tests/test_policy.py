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
    n = 10_000
    glob = spec.global_bytes(n)
    assert parse_policy("bounded-replay").persistent_bytes(spec, n, boundaries=3) == glob
    assert parse_policy("exact-recompute").persistent_bytes(spec, n, boundaries=3) == glob
    assert parse_policy("boundary-snapshot").persistent_bytes(spec, n, boundaries=3) == glob + 3 * 2_703_360
    assert parse_policy("full-store").persistent_bytes(spec, n, boundaries=3) == glob + n * 40 * 528
    assert parse_policy("checkpoint:4096").persistent_bytes(spec, n, boundaries=3) == glob + 2 * 2_703_360


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
