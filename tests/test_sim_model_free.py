"""Model-free trace replay: the simulated tiers against the real ones, hand-computed runs, the cost model,
the study's findings, and determinism."""

from __future__ import annotations

import hashlib
import random
from dataclasses import replace
from pathlib import Path

import pytest

from kvdiet.cache.control import Geometry
from kvdiet.cache.keys import KeyKind
from kvdiet.cache.policies import parse_policy
from kvdiet.cache.spec import CacheSpec
from kvdiet.config import load_config
from kvdiet.sim.cost import CostModel, _sum_min_floor, _window_reads
from kvdiet.sim.model_free import simulate
from kvdiet.sim.records import SimConfig
from kvdiet.sim.size_tier import SizeTier
from kvdiet.sim.study import findings, parse_run, parse_sweep, run_study
from kvdiet.sim.traces import Trace, TraceRequest
from kvdiet.storage.clock import ManualClock
from kvdiet.storage.persistent import PersistentStore, StoreIdentity
from kvdiet.storage.swa_pool import InProcessSwaPool

V41 = load_config("deepseek-v4.1-flash")
BLOCK_BYTES = 890 * 512  # one 512-token block of V4.1 global KV
SNAPSHOT = 40 * 128 * (528 + 8) + 3 * 8 + 3 * 8 + 16
"""A V4.1 window snapshot at a block boundary: 40 rings of 128 entries and positions, 3 empty compressor
tails' counts, the Engram history (3 ids) and the frame: 2,744,384 B (`CacheSpec.snapshot_bytes`)."""


def req(t: float, n: int, ids: tuple[int, ...], out: int = 1) -> TraceRequest:
    return TraceRequest(t, n, out, ids, 0)


# --- the simulated tiers behave as the real ones ---


@pytest.mark.parametrize("seed", range(4))
def test_the_size_tier_answers_like_the_in_process_swa_pool(seed: int) -> None:
    rng = random.Random(seed)
    clock = ManualClock()
    real = InProcessSwaPool(1000, ttl_s=5.0, clock=clock)
    sim = SizeTier(1000, 5.0, refresh=True, clock=clock)
    for _ in range(400):
        clock.advance(rng.choice([0.0, 0.5, 1.0, 2.5]))
        key = rng.randrange(12)
        if rng.random() < 0.5:
            size = rng.choice([100, 250, 400, 1200])
            assert real.put_many([(bytes([key]), None, bytes(size))]) == sim.put_many(
                [((KeyKind.POOL_SNAPSHOT, key), None, size)]
            )
        else:
            got = real.get_many([bytes([key])])[0]
            assert (None if got is None else len(got)) == sim.get_many([(KeyKind.POOL_SNAPSHOT, key)])[0]
        real.sweep()
        sim.expire()
        assert (len(real), real.nbytes) == (len(sim), sim.nbytes)
    assert real.counters == sim.counters


def test_the_size_tier_keeps_the_persistent_tiers_ttl_and_lru_rules(tmp_path: Path) -> None:
    clock = ManualClock(1000.0)
    identity = StoreIdentity("cd" * 32, ("fp4_e2m1_e4m3x16",), 2)
    key = [hashlib.sha256(bytes([i])).digest() for i in range(4)]
    toks = [[i, i + 1] for i in range(4)]
    probe = tmp_path / "probe"
    with PersistentStore(probe, identity, ttl_s=10.0, clock=clock) as s:
        s.put(key[0], toks[0], bytes(100))
        file_size = next((probe / "blocks").rglob("*.kvb")).stat().st_size
    with PersistentStore(
        tmp_path / "ssd", identity, ttl_s=10.0, capacity_bytes=2 * file_size, clock=clock
    ) as real:
        sim = SizeTier(2 * file_size, 10.0, refresh=False, clock=clock)

        def put(i: int) -> None:
            assert real.put_many([(key[i], toks[i], bytes(100))]) == sim.put_many(
                [((KeyKind.BLOCK, i), None, file_size)]
            )

        def live(i: int) -> bool:
            assert real.contains_prefix([key[i]]) == sim.contains_prefix([(KeyKind.BLOCK, i)])
            got = real.get_many([key[i]], [toks[i]])[0] is not None
            assert got == (sim.get_many([(KeyKind.BLOCK, i)])[0] is not None)
            return got

        put(0)
        clock.advance(4)
        put(0)  # a live entry is not rewritten: its TTL still ends at 10 s
        clock.advance(5.999)
        assert live(0)
        clock.advance(0.001)
        assert not live(0)  # now >= deadline: expired
        put(1)
        clock.advance(1)
        put(2)
        clock.advance(1)
        assert live(1)  # 1 read: 2 is now the least recently used
        clock.advance(1)
        put(3)
        assert [live(i) for i in (1, 2, 3)] == [True, False, True]


# --- hand-computed runs ---


def test_a_hand_made_trace_gives_the_hand_computed_hits_bytes_and_window_sources() -> None:
    # A: 2 full blocks + 100 tokens. B continues A (same first 2 ids) 60 s later. C shares only block 1.
    trace = Trace([req(0, 1124, (1, 2, 3)), req(60, 1600, (1, 2, 4, 5)), req(61, 700, (1, 9))], 512)
    res = simulate(trace, SimConfig())
    a, b, c = res.requests
    assert (a.hit_tokens, a.window_source, a.computed_tokens) == (0, "none", 1124)
    # B hits A's 2 full blocks at H = 1024 = A's prompt boundary (1123 // 512 × 512): restored from the pool
    assert (b.device_tokens, b.window_source, b.replayed_tokens, b.computed_tokens) == (
        1024,
        "swa-pool",
        0,
        576,
    )
    # C hits block 1 (H = 512): nobody stored a snapshot there, so bounded replay of the last 128 tokens
    assert (c.device_tokens, c.window_source, c.replayed_tokens, c.computed_tokens) == (
        512,
        "replay",
        128,
        188,
    )
    s = res.summary
    # persistent: A's blocks 1, 2 and B's 4 (full blocks only: 5 and 9 are partial; 1-token outputs fill none)
    assert s["persistent_bytes_resident"] == 3 * BLOCK_BYTES == s["persistent_kv_bytes"]
    # pool: A at 1024, B at 1536 (1599 // 512 × 512); C's boundary 512 equals its replayed hit: not stored
    assert s["snapshots_stored"] == 2 and s["swa_pool_bytes_written"] == 2 * SNAPSHOT
    assert s["boundary_hits"] == 1 and s["hit_requests"] == 2
    assert s["window_sources"] == {"swa-pool": 1, "persistent": 0, "window-blocks": 0, "replay": 1, "none": 1}


def test_the_pool_ttl_decides_between_restore_and_replay() -> None:
    trace = Trace([req(0, 1124, (1, 2, 3)), req(100, 1600, (1, 2, 4, 5))], 512)
    # stored at prefill end, a few ms after 0 s: a 100 s TTL still holds at 100 s, 99.9 s does not
    assert simulate(trace, SimConfig(swa_pool_ttl_s=100)).requests[1].window_source == "swa-pool"
    assert simulate(trace, SimConfig(swa_pool_ttl_s=99.9)).requests[1].window_source == "replay"
    # a pool smaller than one snapshot refuses it
    assert simulate(trace, SimConfig(swa_pool_bytes=SNAPSHOT - 1)).requests[1].window_source == "replay"


def test_v4_boundary_snapshots_persist_window_state_and_cost_more_bytes() -> None:
    trace = Trace([req(0, 1124, (1, 2, 3), out=600), req(60, 1600, (1, 2, 4, 5))], 512)
    v4 = simulate(trace, SimConfig(model="deepseek-v4-flash", policy=parse_policy("boundary-snapshot")))
    assert v4.requests[1].window_source == "persistent"
    spec = CacheSpec.from_config(load_config("deepseek-v4-flash"))
    # A: blocks 1, 2 + one output block (1124 + 600 − 1 = 1723 → 3 blocks); B: block 4. Snapshots: A at
    # 1024 (prompt) and 1536 (output end), B at 1536.
    blocks, snaps = 4, 3
    snap = spec.snapshot_bytes(1024)  # = at 1536: every HCA tail empty, every CSA tail its last window
    assert snap == spec.snapshot_bytes(1536) > spec.window_bytes_per_request
    expect = blocks * spec.global_bytes(512) + snaps * snap
    assert v4.summary["persistent_bytes_resident"] == expect
    assert v4.summary["persistent_window_bytes"] == snaps * snap


def test_a_small_device_pool_sends_hits_to_the_persistent_tier() -> None:
    trace = Trace([req(0, 1124, (1, 2, 3)), req(10, 600, (7, 8)), req(20, 1124, (1, 2, 3))], 512)
    big = simulate(trace, SimConfig())
    small = simulate(trace, SimConfig(device_bytes=3 * BLOCK_BYTES))
    assert big.requests[2].device_tokens == 1024 and big.requests[2].persistent_tokens == 0
    # three blocks fit: A holds 1, 2 and its partial third, and frees them last block first, so its partial
    # block and then block 2 are the least recently used; request 1's two blocks (7 and a partial one) evict
    # them: A's repeat finds block 1 on the device and block 2 in the persistent tier
    r = small.requests[2]
    assert (r.device_tokens, r.persistent_tokens, r.window_source) == (512, 512, "swa-pool")


def test_the_global_pool_answers_before_the_persistent_tier_until_its_ttl() -> None:
    trace = Trace([req(0, 1124, (1, 2, 3)), req(10, 600, (7, 8)), req(20, 1124, (1, 2, 3))], 512)
    small = dict(device_bytes=3 * BLOCK_BYTES)
    # as above, A's repeat finds block 1 on the device; block 2 now comes from the global pool
    on = simulate(trace, SimConfig(**small, global_pool_bytes=10 * BLOCK_BYTES, global_pool_ttl_s=60))
    r = on.requests[2]
    assert (r.device_tokens, r.global_pool_tokens, r.persistent_tokens, r.hit_tokens) == (512, 512, 0, 1024)
    s = on.summary
    assert s["global_pool_hit_tokens"] == 512 and s["global_pool_hit_ratio"] == round(
        512 / (1124 + 600 + 1124), 6
    )
    assert s["hit_ratio"] == round(1024 / (1124 + 600 + 1124), 6)  # device 512 + global 512; no disk hit
    # written through like the persistent tier: A's blocks 1, 2 and request 1's block 7
    assert s["global_pool_bytes_written"] == 3 * BLOCK_BYTES == s["persistent_bytes_written"]
    assert on.as_dict()["config"]["global_pool_bytes"] == 10 * BLOCK_BYTES
    # a TTL shorter than the 20 s between A's write and its repeat: the disk continues the run instead, and
    # its block 2 is promoted back into the global pool
    short = simulate(trace, SimConfig(**small, global_pool_bytes=10 * BLOCK_BYTES, global_pool_ttl_s=15))
    r = short.requests[2]
    assert (r.device_tokens, r.global_pool_tokens, r.persistent_tokens) == (512, 0, 512)
    assert short.summary["global_pool_bytes_written"] == 4 * BLOCK_BYTES
    assert short.summary["global_pool_expirations"] >= 1
    # without a global pool the run, its summary and its config are what they always were
    off = simulate(trace, SimConfig(**small))
    assert "global_pool_hit_ratio" not in off.summary and "global_pool_bytes" not in off.as_dict()["config"]
    assert [(r.device_tokens, r.global_pool_tokens, r.persistent_tokens) for r in off.requests][2] == (
        512,
        0,
        512,
    )


def test_exact_recompute_and_checkpoints_recompute_what_the_manager_plans() -> None:
    ids = tuple(range(1, 21))
    trace = Trace([req(0, 20 * 512, ids), req(30, 20 * 512, ids)], 512)  # the same 10,240-token prompt
    exact = simulate(trace, SimConfig(policy=parse_policy("exact-recompute"))).requests[1]
    # H = 19 blocks = 9,728; recompute from H − (128 + 39 × 127) = 4,647, aligned down to 2: 4,646
    assert (exact.hit_tokens, exact.replayed_tokens) == (9728, 9728 - 4646)
    ckpt = simulate(trace, SimConfig(policy=parse_policy("checkpoint:4096"))).requests[1]
    assert (ckpt.window_source, ckpt.replayed_tokens) == ("persistent", 9728 - 8192)


def test_checkpoints_longer_than_the_receptive_field_replay_from_the_exact_start() -> None:
    ids = tuple(range(1, 31))
    trace = Trace([req(0, 30 * 512, ids), req(30, 30 * 512, ids)], 512)  # H = 29 blocks = 14,848
    exact = simulate(trace, SimConfig(policy=parse_policy("exact-recompute"))).requests[1]
    assert exact.replayed_tokens == 14848 - 9766  # 14,848 − 5,081 = 9,767 → 9,766
    # checkpoint:7680: C = 7,680 is before the exact start: recompute from 9,766, not 7,168 tokens from C
    late = simulate(trace, SimConfig(policy=parse_policy("checkpoint:7680"))).requests[1]
    assert (late.window_source, late.replayed_tokens) == ("replay", 14848 - 9766)
    # checkpoint:14336: C = 14,336 is past it: restore C and recompute 512
    near = simulate(trace, SimConfig(policy=parse_policy("checkpoint:14336"))).requests[1]
    assert (near.window_source, near.replayed_tokens) == ("persistent", 512)


def test_peak_written_and_byte_hours_are_exact_when_entries_expire_before_the_end() -> None:
    # three 1,100-token prompts with their own blocks: A at 0 s, B at 10 s, C at 1,000 s; persistent TTL 100 s
    trace = Trace([req(0, 1100, (1, 2, 3)), req(10, 1100, (4, 5, 6)), req(1000, 1100, (7, 8, 9))], 512)
    cfg = SimConfig(persistent_ttl_s=100, swa_pool_ttl_s=300, output_tok_s=1e12, samples=2)
    s = simulate(trace, cfg).summary
    # each writes 2 blocks and one pool snapshot (at 1,024); A's and B's blocks overlap (10 … 100 s)
    assert s["persistent_bytes_peak"] == 4 * BLOCK_BYTES
    assert s["persistent_bytes_written"] == 6 * BLOCK_BYTES
    assert s["persistent_bytes_end"] == s["persistent_bytes_resident"] == 2 * BLOCK_BYTES
    # A's and B's blocks live exactly 100 s each; C's only until the end of the trace (its own prefill, ms)
    assert s["persistent_byte_hours"] == pytest.approx(4 * BLOCK_BYTES * 100 / 3600, rel=1e-3)
    # the pool holds A's and B's snapshots together (10 … 300 s); sampled at 0 and 1,000 s it never shows 2
    assert s["swa_pool_bytes_peak"] == 2 * SNAPSHOT and s["swa_pool_bytes_end"] == SNAPSHOT
    assert s["swa_pool_byte_hours"] == pytest.approx(2 * SNAPSHOT * 300 / 3600, rel=1e-3)
    assert max(simulate(trace, cfg).series["swa_pool_bytes"]) < s["swa_pool_bytes_peak"]


def test_the_window_share_is_read_at_the_persistent_peak() -> None:
    spec = CacheSpec.from_config(load_config("deepseek-v4-flash"))
    block, snap = spec.global_bytes(512), spec.snapshot_bytes(1024)
    trace = Trace([req(0, 1100, (1, 2, 3)), req(10, 1100, (4, 5, 6)), req(1000, 1100, (7, 8, 9))], 512)
    cfg = SimConfig(model="deepseek-v4-flash", policy=parse_policy("boundary-snapshot"), persistent_ttl_s=100)
    s = simulate(trace, cfg).summary
    assert s["persistent_bytes_peak"] == 4 * block + 2 * snap
    assert s["persistent_window_share_at_peak"] == round(2 * snap / (4 * block + 2 * snap), 4)
    assert s["persistent_window_bytes_written"] == 3 * snap and s["persistent_kv_bytes_written"] == 6 * block


def test_v4_flash_runs_a_64_token_trace_at_its_engines_128_token_blocks() -> None:
    cfg = load_config("deepseek-v4-flash")
    spec = CacheSpec.from_config(cfg)
    g = Geometry.from_config(cfg, 64)
    assert g.block_cycle == (spec.global_bytes(64), spec.global_bytes(128) - spec.global_bytes(64))
    assert g.block_cycle[1] > g.block_cycle[0]  # the ratio-128 entries complete in every second block
    assert Geometry.from_config(load_config("deepseek-v4.1-flash"), 64).block_cycle == ()
    trace = Trace([req(0, 200, (1, 2, 3, 4)), req(30, 200, (1, 2, 3, 4))], 64)
    res = simulate(trace, SimConfig(model="deepseek-v4-flash", policy=parse_policy("boundary-snapshot")))
    # the engine's blocks are 128 tokens: one full block written (was 3 of 64, a hit of 192 tokens)
    assert res.summary["block_size"] == 128
    assert res.summary["persistent_kv_bytes_written"] == spec.global_bytes(128)
    assert res.requests[1].hit_tokens == 128 and res.requests[1].window_source == "persistent"
    v41 = simulate(trace, SimConfig(model="deepseek-v4.1-flash")).summary  # its compress ratios divide 64
    assert v41["block_size"] == 64 and v41["persistent_kv_bytes_written"] == CacheSpec.from_config(
        load_config("deepseek-v4.1-flash")
    ).global_bytes(192)


def _sessions(block: int, first: int) -> Trace:
    """Three sessions of growing prompts (each turn its previous prompt and output plus 300–2,900 new tokens,
    outputs 1–700), written at ``block``-token blocks with chained ids (session s, block i: a number of its
    own from ``first`` on), interleaved in time."""
    rng, reqs = random.Random(7), []
    for s in range(3):
        n, t = 0, 17.0 * s
        for _ in range(8):
            n += rng.randrange(300, 2900)
            out = rng.randrange(1, 700)
            ids = tuple(first + s * 10_000 + i for i in range(-(-n // block)))
            reqs.append(TraceRequest(t, n, out, ids, 0))
            n, t = n + out, t + rng.randrange(5, 200)
    reqs.sort(key=lambda r: r.arrival_s)
    return Trace(reqs, block)


def test_a_64_token_trace_run_as_v4_flash_is_the_same_trace_written_at_128_token_blocks() -> None:
    """V4-Flash's engine snapshots only at multiples of 128 tokens: every snapshot a 64-token trace stores is
    4,118,872 B (was a mix with 9,361,752-B ones between HCA groups, which the engine never writes), and every
    figure equals the one of the same sessions written at 128-token blocks."""
    v4 = SimConfig(model="deepseek-v4-flash", policy=parse_policy("boundary-snapshot"))
    at64, at128 = (simulate(_sessions(b, f), v4).summary for b, f in ((64, 0), (128, 500_000)))
    assert at64["snapshots_stored"] > 20
    assert at64["persistent_window_bytes_written"] == at64["snapshots_stored"] * 4_118_872
    assert at64 == at128
    study = run_study(_sessions(64, 0), [v4, SimConfig()], jobs=2)  # forked, once per block size
    assert study.runs[0].summary == at64 and study.runs[1].summary["block_size"] == 64


def test_figures_split_by_context_regime_add_up_by_hand() -> None:
    long_ids = tuple(range(100, 179))  # 79 ids for 40,000 tokens (78 full blocks + a partial one)
    trace = Trace([req(0, 1100, (1, 2, 3)), req(10, 1100, (1, 2, 3)), req(20, 40_000, long_ids)], 512)
    s = simulate(trace, SimConfig()).summary
    assert "by_kind" not in s and "by_session" not in s  # the trace names neither
    short, mid = s["by_regime"]["≤32K"], s["by_regime"]["32K-200K"]
    assert list(s["by_regime"]) == ["≤32K", "32K-200K"]
    assert (short["requests"], short["prompt_tokens"], short["hit_tokens"]) == (2, 2200, 1024)
    assert (short["restores"], short["replays"], short["recomputed_tokens"]) == (1, 0, 1100 + 76)
    # the repeat restored its state at 1,024 and wrote nothing new: A's 2 blocks and 1 snapshot only
    assert (short["persistent_bytes_written"], short["swa_pool_bytes_written"]) == (2 * BLOCK_BYTES, SNAPSHOT)
    assert (mid["requests"], mid["hit_tokens"], mid["recomputed_tokens"]) == (1, 0, 40_000)
    assert (mid["persistent_bytes_written"], mid["swa_pool_bytes_written"]) == (78 * BLOCK_BYTES, SNAPSHOT)
    assert short["hit_ratio"] == round(1024 / 2200, 6)


def test_restores_of_superseded_snapshots_are_counted_and_supersede_drops_them() -> None:
    # A stores its snapshot at 1,024; B continues A (restores it) and stores a newer one at 1,536 on the same
    # chain; C repeats A and restores the 1,024 snapshot, which is no longer its chain's newest
    trace = Trace([req(0, 1100, (1, 2, 3)), req(10, 1600, (1, 2, 4, 5)), req(20, 1100, (1, 2, 3))], 512)
    keep = simulate(trace, SimConfig())
    assert [r.window_source for r in keep.requests] == ["none", "swa-pool", "swa-pool"]
    s = keep.summary
    assert s["pool_restores_of_older_snapshots"] == 1
    assert s["swa_pool_bytes_peak"] == 2 * SNAPSHOT
    drop = simulate(trace, SimConfig(swa_pool_supersede=True))
    # B's snapshot replaced A's: C finds nothing at 1,024 and replays its last 128 tokens
    assert [r.window_source for r in drop.requests] == ["none", "swa-pool", "replay"]
    d = drop.summary
    assert (d["pool_restores_of_older_snapshots"], d["swa_pool_bytes_peak"]) == (0, SNAPSHOT)
    assert d["swa_pool_bytes_written"] == 2 * SNAPSHOT  # C's boundary 1,024 is its replayed hit: not stored


def test_the_same_trace_and_config_give_identical_results() -> None:
    rng = random.Random(7)
    reqs = []
    for i in range(300):
        conv = rng.randrange(20)
        depth = rng.randrange(1, 6)
        ids = tuple(conv * 100 + k for k in range(depth))
        reqs.append(req(i * 0.7, depth * 512 - rng.randrange(400), ids, out=rng.randrange(1, 900)))
    trace = Trace(reqs, 512)
    a, b = simulate(trace, SimConfig()), simulate(trace, SimConfig())
    assert a.as_dict() == b.as_dict() and a.requests == b.requests
    study = run_study(
        trace, [SimConfig(), replace(SimConfig(), policy=parse_policy("exact-recompute"))], jobs=2
    )
    assert study.runs[0].as_dict() == a.as_dict()


# --- cost model ---


def test_sum_min_floor_matches_brute_force() -> None:
    for n in range(0, 60):
        for cap in (1, 3, 7):
            for r in (1, 2, 4):
                assert _sum_min_floor(n, cap, r) == sum(min(cap, p // r) for p in range(n))


@pytest.mark.parametrize("model", ["deepseek-v4.1-flash", "deepseek-v4-flash"])
def test_cumulative_flops_are_the_plain_sums(model: str) -> None:
    """The written-out sums of `CostModel._cumulative` equal the per-class formula over `_window_reads` and
    `_sum_min_floor`, on every layer set, below and past the window and the top-k cap."""
    cost, cfg = CostModel(load_config(model)), load_config(model)
    per_read = 4 * cfg.num_attention_heads * cfg.head_dim
    per_score = 2 * cfg.index_n_heads * cfg.index_head_dim
    for which, (linear, classes) in cost._classes.items():
        for n in (0, 1, 5, 127, 128, 129, 4096, 65_537, 600_000, 1_000_003):
            plain = linear * n
            for count, ratio, cap, indexer in classes:
                reads = _window_reads(n, cfg.sliding_window) + (_sum_min_floor(n, cap, ratio) if ratio else 0)
                scores = _sum_min_floor(n, 1 << 62, ratio) if indexer else 0
                plain += count * (per_read * reads + per_score * scores)
            assert cost._cumulative(which, n) == plain, (model, which, n)


def test_prefill_costs_follow_the_layer_plan() -> None:
    cost = CostModel(V41)
    enc_only = cost.prefill_flops(0, 4096)
    every_row = cost.prefill_flops(0, 4096, decoder_every_row=True)
    assert every_row > 1.6 * enc_only  # the decoder half of the layers runs on every row instead of 128
    # chunks add up (the LM head once per chunk; the decoder on each chunk's last 128 rows)
    head = 2.0 * V41.hidden_size * V41.vocab_size
    two = cost.prefill_flops(0, 2048) + cost.prefill_flops(2048, 4096)
    assert two > enc_only and two - head < enc_only + cost.replay_flops(1920, 2048)
    # linear part: 2 FLOPs per active parameter; V4.1's prefill activates about 8B, decode about 16B
    per_token = cost.replay_flops(0, 1) / 1e9
    assert 28 < per_token < 34
    assert cost.seconds(1979e12 * 0.5) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="unknown GPU"):
        CostModel(V41, gpu="tpu")


# --- study ---


def test_findings_of_a_trace_v4_persists_nothing_of_are_none_and_the_report_says_n_a() -> None:
    """Prompts under V4-Flash's 128-token block: V4 persists no byte, so its window share is None (not 0.0, beside
    ratios that are None); where V4 persisted window snapshots but no global KV, the report reads "n/a" for the
    global ratio instead of failing to format None."""
    from kvdiet.sim.report import _facts_text

    trace = Trace([req(0, 40, (1,), out=4), req(3, 40, (1,), out=4)], 16)
    base = SimConfig()
    runs = [parse_run("bounded-replay", base), parse_run("boundary-snapshot@deepseek-v4-flash", base)]
    f = findings(run_study(trace, runs, [], jobs=1))
    assert f["persistent_bytes_v4"] == 0 and f["persistent_ratio_v41_over_v4"] is None
    assert f["v4_window_share"] is None and f["global_kv_ratio_v41_over_v4"] is None
    only_windows = {
        "persistent_ratio_v41_over_v4": 0.5, "persistent_bytes_v41": 10, "persistent_bytes_v4": 20,
        "persistent_ratio_written": 0.5, "persistent_ratio_byte_hours": 0.5, "v4_window_share": 1.0,
        "v4_window_share_written": 1.0, "global_kv_ratio_v41_over_v4": None,
    }  # fmt: skip
    assert "global KV alone n/a." in _facts_text(only_windows)


def test_study_findings_are_ratios_of_the_runs() -> None:
    trace = Trace([req(0, 1124, (1, 2, 3), out=600), req(60, 1600, (1, 2, 4, 5))], 512)
    base = SimConfig()
    runs = [parse_run("bounded-replay", base), parse_run("boundary-snapshot@deepseek-v4-flash", base)]
    study = run_study(trace, runs, [(parse_sweep("swa-pool-ttl=30s,2m"), runs[0])], jobs=1)
    f = findings(study)
    v41, v4 = (r.summary for r in study.runs)
    assert f["persistent_ratio_v41_over_v4"] == round(
        v41["persistent_bytes_peak"] / v4["persistent_bytes_peak"], 4
    )
    # the window share is read at V4's peak, not from what is left at the end
    assert f["v4_window_share"] == v4["persistent_window_share_at_peak"] > 0
    assert f["persistent_ratio_byte_hours"] == round(
        v41["persistent_byte_hours"] / v4["persistent_byte_hours"], 4
    )
    assert [label for label, _ in study.sweeps["swa-pool-ttl"]] == ["30s", "2m", "unbounded"]
    assert f["ttl_catch_share"] == {"30s": 0.0, "2m": 1.0} and f["ttl_for_catch"] == "2m"
    with pytest.raises(ValueError, match="AXIS"):
        parse_sweep("pool=1")
    with pytest.raises(ValueError, match="unknown SWA policy"):
        parse_run("lru@deepseek-v4.1-flash", base)
    with pytest.raises(ValueError, match="multiple of the block size 512 it runs at"):
        simulate(trace, SimConfig(policy=parse_policy("checkpoint:1000")))
