"""Engine-mode trace replay: scaled traces, synthesized prompts, and the real engine's hit/miss sequence equal
to the model-free simulation's on the same trace (policies, a binding SWA-pool TTL, a small device pool, the
global pool on a real Mooncake master)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvdiet.cache.policies import parse_policy
from kvdiet.cache.spec import CacheSpec
from kvdiet.config import load_config
from kvdiet.engine.runner import CacheOptions
from kvdiet.sim.engine_mode import EngineModeConfig, prompt_ids, run_engine_mode, scale_trace
from kvdiet.sim.traces import Trace, TraceRequest
from mooncake_helpers import master_with_segment
from v4_helpers import tiny_v4_config

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"


def req(t: float, n: int, ids: tuple[int, ...], out: int = 32, line: int = 0) -> TraceRequest:
    return TraceRequest(t, n, out, ids, line)


# Conversations on 512-token blocks: continuations, a shared first block, an exact repeat.
TRACE = Trace(
    [
        req(0.0, 1100, (1, 2, 3), out=40),
        req(1.0, 1700, (1, 2, 3, 4), out=30),
        req(2.0, 600, (1, 5), out=20),
        req(3.0, 2100, (1, 2, 3, 4, 6), out=10),
        req(4.0, 1024, (1, 2), out=5),
        req(5.0, 1100, (1, 2, 3), out=40),
    ],
    512,
)


def test_scale_trace_shrinks_blocks_and_keeps_ids() -> None:
    small = scale_trace(TRACE, 16)
    assert small.block_size == 16
    # 1100 = 2 × 512 + 76 → 2 × 16 + ceil(76 × 16 / 512) = 35; outputs at least 1 token
    assert [r.input_tokens for r in small.requests] == [35, 54, 19, 66, 32, 35]
    assert [r.output_tokens for r in small.requests] == [2, 1, 1, 1, 1, 2]
    assert all(-(-r.input_tokens // 16) == len(r.hash_ids) for r in small.requests)
    with pytest.raises(ValueError):
        scale_trace(TRACE, 0)


def test_prompts_depend_only_on_the_id_at_each_position() -> None:
    small = scale_trace(TRACE, 16).requests
    a, b, c = (prompt_ids(small[i], i, 16, 129_280) for i in (0, 1, 2))
    assert a[:32] == b[:32] and a[32:35] == b[32:35]  # same ids (1, 2, 3): same tokens
    assert a[:16] == c[:16] and a[16:19] != c[16:19]  # block 2 has id 2 in A, 5 in C
    assert len(a) == 35 and all(1000 <= t < 129_280 for t in a)
    assert prompt_ids(small[0], 0, 16, 129_280, seed=1) != a
    no_ids = TraceRequest(0.0, 20, 1, None, 0)
    assert prompt_ids(no_ids, 0, 16, 129_280) != prompt_ids(no_ids, 1, 16, 129_280)


@pytest.mark.parametrize(
    "policy", ["bounded-replay", "boundary-snapshot", "full-store", "checkpoint:32", "exact-recompute"]
)
def test_engine_and_model_free_give_the_same_sequence(policy: str) -> None:
    cfg = EngineModeConfig(
        model="v4.1-micro", max_requests=6, cache=CacheOptions(policy=parse_policy(policy))
    )
    res = run_engine_mode(TRACE, cfg)
    assert res.requests == res.model_free and res.agreeing == 6
    assert len(res.ttft_s) == 6 and all(t > 0 for t in res.ttft_s)
    sources = {r.window_source for r in res.requests}
    expect = {
        "bounded-replay": {"none", "swa-pool", "replay"},
        "boundary-snapshot": {"none", "persistent"},
        "full-store": {"none", "window-blocks"},
        "checkpoint:32": {"none", "persistent"},
        "exact-recompute": {"none"},  # micro: 8 + 8 × 7 = 64-token receptive field, longer than every hit
    }[policy]
    assert sources == expect
    if policy == "bounded-replay":
        assert res.requests[3].window_source == "swa-pool" and res.requests[3].hit_tokens == 48


def test_a_binding_pool_ttl_and_a_small_device_pool_agree_too() -> None:
    # TTL 1.5 s: request 1 (at 1 s) finds request 0's snapshot; request 3 (at 3 s) no longer finds request
    # 1's (stored at 1 s, at its prompt boundary 48), which it restores under the default 5 min
    opts = CacheOptions(swa_pool_ttl_s=1.5)
    res = run_engine_mode(TRACE, EngineModeConfig(model="v4.1-micro", max_requests=6, cache=opts))
    assert res.requests == res.model_free
    assert [r.window_source for r in res.requests[:4]] == ["none", "swa-pool", "replay", "replay"]
    assert res.requests[3].hit_tokens == 48
    # a device pool of 5 blocks of 16 tokens: B's 5 blocks evict all of A's (2 full + 1 partial), so A's
    # repeat loads its 2 full blocks back from the persistent tier
    block = CacheSpec.from_config(load_config("v4.1-micro")).global_bytes(16)
    trace = Trace([req(0, 1100, (1, 2, 3)), req(1, 2100, (7, 8, 9, 10, 11)), req(2, 1100, (1, 2, 3))], 512)
    opts = CacheOptions(kv_cache_memory=5 * block)
    res = run_engine_mode(trace, EngineModeConfig(model="v4.1-micro", max_requests=3, cache=opts))
    assert res.requests == res.model_free
    assert (res.requests[2].device_tokens, res.requests[2].persistent_tokens) == (0, 32)
    big = run_engine_mode(trace, EngineModeConfig(model="v4.1-micro", max_requests=3))
    assert big.requests == big.model_free and big.requests[2].device_tokens == 32
    assert big.summary()["policy"] == "bounded-replay"  # left unset: the model's, in both modes


@pytest.mark.slow
def test_kvdiet_replay_engine_mode_runs_v41_mini_on_a_capped_trace(tmp_path: Path, capsys) -> None:
    from kvdiet.cli import main

    path = tmp_path / "t.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": r.arrival_s * 1000,
                    "input_length": r.input_tokens,
                    "output_length": r.output_tokens,
                    "hash_ids": list(r.hash_ids),
                }
            )
            + "\n"
            for r in TRACE.requests
        )
    )
    report = tmp_path / "report"
    argv = ["replay", str(path), "--mode", "engine", "--max-requests", "4", "--json", "--report", str(report)]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    (run,) = out["engine"]
    assert run["model"] == "v4.1-mini" and run["requests"] == 4 and run["model_free_agreeing"] == 4
    # v4.1-mini's window is 128 tokens: a hit of <= 128 tokens is adopted only with a pool snapshot, so
    # request 2 (a 16-token hit, no snapshot there) runs cold; 1 and 3 restore 0's and 1's prompt boundaries
    assert len(run["ttft_s"]) == 4 and run["window_sources"] == {"none": 2, "swa-pool": 2}
    assert (report / "ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Engine mode" in (report / "report.md").read_text()


@pytest.mark.slow
@pytest.mark.skipif(not SHARED.is_dir(), reason="the shared trace copies are not on this machine")
def test_engine_mode_on_a_slice_of_the_real_conversation_trace(capsys) -> None:
    from kvdiet.cli import main

    trace = SHARED / "mooncake" / "conversation_trace.jsonl"
    assert main(["replay", str(trace), "--mode", "engine", "--max-requests", "3", "--json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["engine"]
    assert run["requests"] == 3 and run["model_free_agreeing"] == 3


def test_time_scaled_arrivals_overlap_and_all_finish() -> None:
    # 6 requests over 5 trace seconds replayed at 0.02 wall s per trace s: they arrive while others run
    cfg = EngineModeConfig(model="v4.1-micro", max_requests=6, time_scale=0.02)
    res = run_engine_mode(TRACE, cfg)
    assert len(res.requests) == 6 and all(r is not None for r in res.requests)
    assert [r.hit_tokens + r.computed_tokens for r in res.requests] == [35, 54, 19, 66, 32, 35]
    assert all(t > 0 for t in res.ttft_s) and res.wall_s >= 5 * 0.02
    with pytest.raises(ValueError, match="time_scale"):
        run_engine_mode(TRACE, EngineModeConfig(model="v4.1-micro", time_scale=-1))


def test_a_request_past_the_context_or_the_pool_is_refused_in_replays_terms() -> None:
    """The engine's context is the longest replayed request: past the model's limit or the device pool, replay names
    the request and its own flags (was the engine's "--max-model-len", a flag replay does not take)."""
    long = Trace([req(0.0, 20000, tuple(range(40)), out=56)], 512)  # 625 + 2 tokens at 16-token blocks
    with pytest.raises(ValueError) as err:
        run_engine_mode(long, EngineModeConfig(model="v4.1-micro"))
    assert str(err.value) == (
        "the longest replayed request, 627 tokens (prompt + output at block size 16), is past v4.1-micro's "
        "max_position_embeddings 256: replay a model with a longer context (--engine-model)"
    )
    small = CacheOptions(kv_cache_memory=4000)  # two blocks of 1,696 B; the first request needs three
    with pytest.raises(ValueError) as err:
        run_engine_mode(TRACE, EngineModeConfig(model="v4.1-micro", max_requests=1, cache=small))
    assert str(err.value) == (
        "the longest replayed request, 37 tokens (prompt + output at block size 16), needs 3 blocks but the KV "
        "cache holds 2: raise --kv-cache-memory to at least 5,088 bytes"
    )
    run_engine_mode(
        TRACE,
        EngineModeConfig(model="v4.1-micro", max_requests=1, cache=replace(small, kv_cache_memory=5088)),
    )


def test_requests_sharing_a_timestamp_run_in_order_in_both_modes() -> None:
    # the Mooncake traces start with many requests at 0 ms: the second one hits the first one's blocks
    trace = Trace([req(0.0, 1100, (1, 2, 3)), req(0.0, 1100, (1, 2, 3)), req(0.0, 700, (1, 9))], 512)
    res = run_engine_mode(trace, EngineModeConfig(model="v4.1-micro", max_requests=3))
    assert [r.arrival_s for r in res.trace.requests] == [0.0, 0.001, 0.002]
    assert res.requests == res.model_free and res.requests[1].hit_tokens == 32


def test_v4_and_v41_on_the_same_slice_agree_with_the_model_free_runs_and_measure_their_bytes(
    tmp_path,
) -> None:
    """The same slice through a tiny V4-Flash (boundary-snapshot) and V4.1 (bounded-replay) engine, blocks
    of 128 tokens: each hit/miss sequence equals its model-free run, and the bytes the engine wrote are the
    model-free payload bytes plus what only the engine stores (entry headers with the block's token ids;
    snapshots carry the compressor-tail rows in use and ring positions beside the rings the model-free run
    counts)."""
    v4 = tmp_path / "v4.json"
    v4.write_text(
        json.dumps(
            tiny_v4_config().replace(head_dim=128, qk_rope_head_dim=64, index_head_dim=64).to_json_dict()
        )
    )
    v41 = tmp_path / "v41.json"
    v41.write_text(json.dumps(load_config("v4.1-micro").replace(max_position_embeddings=4096).to_json_dict()))
    runs = {}
    for model, policy in ((v4, "boundary-snapshot"), (v41, "bounded-replay")):
        cfg = EngineModeConfig(
            model=str(model), block_size=128, max_requests=6, cache=CacheOptions(policy=parse_policy(policy))
        )
        runs[policy] = res = run_engine_mode(TRACE, cfg)
        assert res.requests == res.model_free and res.agreeing == 6
        s = res.summary()
        assert s["snapshots_stored"] == s["model_free_snapshots_stored"] > 0
        spec = CacheSpec.from_config(load_config(str(model)))
        assert res.model_free_summary["block_bytes"] == spec.global_bytes(128)
        extra = s["persistent_bytes_written"] - s["model_free_persistent_bytes_written"]
        assert extra > 0
        if policy == "bounded-replay":  # blocks only: the difference is the entry headers
            assert extra < s["persistent_entries_written"] * 1_000
        else:  # snapshots also hold the tail rows in use (at a block boundary: each CSA tail's last window;
            # no HCA row), never the whole allocated tails
            assert extra < s["snapshots_stored"] * spec.tail_bytes_per_request // 2
    v4_sources = {r.window_source for r in runs["boundary-snapshot"].requests}
    assert v4_sources == {"none", "persistent"}


master = pytest.fixture(scope="module")(master_with_segment)


def test_a_run_with_the_global_pool_agrees_and_splits_hits_over_three_tiers(master) -> None:
    # a device pool of 5 blocks of 16 tokens; a global pool with a TTL of 100 trace seconds. Request 2 repeats
    # request 0 after request 1 evicted it from the device pool: its 2 blocks come from the global pool.
    # Request 3 repeats request 1 at 300 s: the device pool kept its first 2 blocks, the global pool's copies
    # of the next 2 have expired, so the persistent tier continues the run.
    block = CacheSpec.from_config(load_config("v4.1-micro")).global_bytes(16)
    trace = Trace(
        [
            req(0, 1100, (1, 2, 3)),
            req(1, 2100, (7, 8, 9, 10, 11)),
            req(2, 1100, (1, 2, 3)),
            req(300, 2100, (7, 8, 9, 10, 11)),
        ],
        512,
    )
    opts = CacheOptions(
        kv_cache_memory=5 * block, global_pool=master.url, global_pool_size=0, global_pool_ttl_s=100.0
    )
    res = run_engine_mode(trace, EngineModeConfig(model="v4.1-micro", max_requests=4, cache=opts))
    assert res.requests == res.model_free and res.agreeing == 4
    split = [(r.device_tokens, r.global_pool_tokens, r.persistent_tokens) for r in res.requests]
    assert split == [(0, 0, 0), (0, 0, 0), (0, 32, 0), (32, 0, 32)]
    s = res.summary()
    assert s["global_pool_hit_ratio"] == round(32 / (35 + 66 + 35 + 66), 6)
    assert s["global_pool_bytes_written"] > 0
    assert res.model_free_summary["global_pool_hit_tokens"] == 32
