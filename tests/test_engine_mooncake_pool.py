"""The cache system and its commands on the Mooncake SWA pool (v4.1-micro, a real mooncake_master): a hit
restores exactly; the master down at start-up or killed mid-run turns hits into bounded replays, never
errors; two engine processes sharing one master (and a standalone segment holder) continue each other's
prompts exactly; an engine that held the segment takes the snapshots with it."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from kvdiet.config import load_config
from kvdiet.engine.runner import ModelRunner
from kvdiet.model.transformer import Transformer
from kvdiet.storage.mooncake_pool import MooncakeSwaPool
from mooncake_helpers import MooncakeMaster, SegmentHolder
from pool_engine_helpers import W, generate_here, generate_process, pool_cache
from pool_engine_helpers import close as _close
from pool_engine_helpers import ids as _ids
from pool_engine_helpers import run_one as _run
from pool_engine_helpers import same as _same
from redis_helpers import free_port


@pytest.fixture(scope="module")
def micro() -> Transformer:
    return Transformer.from_config(load_config("v4.1-micro"), seed=3, exact=True)


def _wait_until_it_stores(pool: MooncakeSwaPool, timeout_s: float = 60.0) -> None:
    """Poll until a value round-trips through the (restarted) master: how long the client takes to mount its
    segment again depends on the machine's load, so no fixed sleep."""
    deadline = time.monotonic() + timeout_s
    while not (pool.put(b"probe", b"probe") and pool.get_many([b"probe"])[0] == b"probe"):
        assert time.monotonic() < deadline, (
            f"no value round-trips {timeout_s:.0f} s after the master restarted"
        )
        time.sleep(0.3)


@pytest.mark.slow
def test_killed_mid_run_requests_complete_with_replay_then_hit_again(micro, tmp_path: Path) -> None:
    ids = _ids(61)
    with MooncakeMaster(tmp_path) as master, _cache(micro, master.url) as cache:
        pool = cache.swa_pool
        assert isinstance(pool, MooncakeSwaPool) and pool.namespace == cache.fingerprint.hex()
        pool.backoff_s = 0.3
        _, cold = _run(cache, ids)
        s, warm = _run(cache, ids)  # the device pool has the blocks, Mooncake the window state at 60
        p = s.provenance
        assert (p.device_tokens, p.window_source, p.replayed_tokens) == (60, "swa-pool", 0)
        assert _same(cold, warm)
        master.stop()
        s, replayed = _run(cache, ids)  # the lookup fails: a replay, not an error
        assert (s.provenance.window_source, s.provenance.replayed_tokens) == ("replay", W)
        assert _close(cold, replayed)
        c = cache.stats.swa_pool
        assert c.backend_errors >= 1 and c.hits == 1 and cache.stats.snapshots_stored == 1
        master.start()  # same port, knowing no keys
        _wait_until_it_stores(pool)  # past the back-off, and the client has mounted its segment again
        hits = c.hits
        s, _ = _run(cache, ids)  # a miss on the empty master (a replayed window is not stored: approximate)
        assert s.provenance.window_source == "replay" and pool.reachable
        other = _ids(61, seed=5)
        _, cold_other = _run(cache, other)  # computed exactly: stored on the restarted master
        s, again = _run(cache, other)
        assert (s.provenance.window_source, s.provenance.replayed_tokens) == ("swa-pool", 0)
        assert _same(cold_other, again) and c.hits == hits + 1 and c.corrupt_dropped == 0
        assert cache.stats.snapshots_stored == 2
        assert cache.stats.as_dict()["swa_pool"]["backend_errors"] == c.backend_errors


def test_down_at_start_up_one_warning_and_bounded_replay(micro, caplog) -> None:
    ids = _ids(61, seed=2)
    url = f"mooncake://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, logger="kvdiet.storage.mooncake_pool"), _cache(micro, url) as cache:
        _, cold = _run(cache, ids)
        s, out = _run(cache, ids)
    p = s.provenance
    assert (p.device_tokens, p.window_source, p.replayed_tokens) == (60, "replay", W)
    assert _close(cold, out)
    c = cache.stats.swa_pool
    assert c.backend_errors >= 1 and c.hits == 0 and cache.stats.snapshots_stored == 0
    assert [r.getMessage().split(": ", 1)[1][:25] for r in caplog.records] == ["unreachable at start-up ("]


# --- processes ---


_generate = generate_process
_generate_here = generate_here


@pytest.mark.slow
def test_two_processes_share_snapshots_and_continue_exactly(tmp_path: Path, capsys) -> None:
    """One engine process finishes a prompt and exits; another, given the prompt + its output + one more
    token, gets the global KV from the shared persistent directory and the window state at 60 from Mooncake
    (held by a standalone segment holder: the engines give no segment), and produces exactly the tokens of a
    run without any cache. An engine that held the only segment takes the snapshots with it."""
    prompt = [i % 64 for i in range(1, 61)]
    flags = ["--json", "--no-decoder-replay"]
    with MooncakeMaster(tmp_path / "mc") as master, SegmentHolder(tmp_path / "mc", master):
        shared = ["--persistent-dir", str(tmp_path / "kv"), "--swa-pool", master.url, "--swa-pool-size", "0"]
        a = _generate(["--prompt-ids", ",".join(map(str, prompt)), *flags, *shared])
        assert a["cache_stats"]["swa_pool"]["entries_written"] == 2  # at 56 (prompt) and 60 (finish)
        follow = ",".join(map(str, [*prompt, *a["output_ids"], 7]))
        b = _generate(["--prompt-ids", follow, *flags, *shared])
    cold = _generate_here(["--prompt-ids", follow, *flags], capsys)
    p = b["provenance"]
    assert (p["persistent_tokens"], p["window_source"], p["replayed_tokens"], p["exact"]) == (
        60,
        "swa-pool",
        0,
        True,
    )
    assert b["cache_stats"]["swa_pool"]["hits"] == 1 and b["cache_stats"]["swa_pool"]["backend_errors"] == 0
    assert cold["provenance"]["hit_tokens"] == 0 and b["output_ids"] == cold["output_ids"]

    with MooncakeMaster(tmp_path / "mc2") as master:  # no segment holder: the first engine holds the segment
        shared = [
            "--persistent-dir",
            str(tmp_path / "kv2"),
            "--swa-pool",
            master.url,
            "--swa-pool-size",
            "16MiB",
        ]
        a = _generate(["--prompt-ids", ",".join(map(str, prompt)), *flags, *shared])
        assert a["cache_stats"]["swa_pool"]["entries_written"] == 2
        b = _generate(["--prompt-ids", follow, *flags, *shared])
    p = b["provenance"]
    assert (p["persistent_tokens"], p["window_source"], p["replayed_tokens"]) == (60, "replay", W)
    assert b["cache_stats"]["swa_pool"]["hits"] == 0  # gone with the process that held them


def _cache(model: Transformer, swa_pool: str, segment_bytes: int = 16 << 20) -> ModelRunner:
    """The shared runner with a 16 MiB segment of this process in the pool."""
    return pool_cache(model, swa_pool, segment_bytes)
