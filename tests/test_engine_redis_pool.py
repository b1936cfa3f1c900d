"""The cache system and its commands on the Redis SWA pool (v4.1-micro, real redis-server processes): a hit
restores exactly; Redis down at start-up, killed mid-run or losing keys between the manifest and the chunks
turns hits into bounded replays, never errors; two processes share snapshots; ``kvdiet serve`` warns once,
serves, counts the failures in /metrics and uses the pool once Redis is back."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import redis

from kvdiet.cli import main
from kvdiet.config import load_config
from kvdiet.model.transformer import Transformer
from kvdiet.storage.redis_pool import RedisSwaPool
from pool_engine_helpers import W
from pool_engine_helpers import close as _close
from pool_engine_helpers import ids as _ids
from pool_engine_helpers import pool_cache as _cache
from pool_engine_helpers import run_one as _run
from pool_engine_helpers import same as _same
from redis_helpers import RedisServer, free_port

KVDIET = [sys.executable, "-m", "kvdiet.cli"]


@pytest.fixture(scope="module")
def micro() -> Transformer:
    return Transformer.from_config(load_config("v4.1-micro"), seed=3, exact=True)


@pytest.mark.slow
def test_killed_mid_run_requests_complete_with_replay_then_hit_again(micro, tmp_path: Path) -> None:
    ids = _ids(61)
    with RedisServer(tmp_path) as server, _cache(micro, server.url) as cache:
        pool = cache.swa_pool
        assert isinstance(pool, RedisSwaPool) and pool.namespace == cache.fingerprint.hex()
        pool.backoff_s = 0.3
        _, cold = _run(cache, ids)
        s, warm = _run(cache, ids)  # the device pool has the blocks, Redis the window state at 60
        assert (s.provenance.device_tokens, s.provenance.window_source, s.provenance.replayed_tokens) == (
            60,
            "swa-pool",
            0,
        )
        assert _same(cold, warm)
        server.stop()
        s, replayed = _run(cache, ids)  # the lookup fails: a replay, not an error
        assert (s.provenance.window_source, s.provenance.replayed_tokens) == ("replay", W)
        assert _close(cold, replayed)
        c = cache.stats.swa_pool
        assert c.backend_errors >= 1 and c.hits == 1 and cache.stats.snapshots_stored == 1
        server.start()  # same port, empty
        time.sleep(0.35)
        s, _ = _run(cache, ids)  # a miss on the empty server (a replayed window is not stored: approximate)
        assert s.provenance.window_source == "replay" and pool.reachable
        other = _ids(61, seed=5)
        _, cold_other = _run(cache, other)  # computed exactly: stored on the restarted server
        s, again = _run(cache, other)
        assert (s.provenance.window_source, s.provenance.replayed_tokens) == ("swa-pool", 0)
        assert _same(cold_other, again) and c.hits == 2 and c.corrupt_dropped == 0
        assert cache.stats.snapshots_stored == 2
        assert cache.stats.as_dict()["swa_pool"]["backend_errors"] == c.backend_errors


def test_down_at_start_up_one_warning_and_bounded_replay(micro, caplog) -> None:
    ids = _ids(61, seed=2)
    url = f"redis://127.0.0.1:{free_port()}/0"
    with caplog.at_level(logging.WARNING, logger="kvdiet.storage.redis_pool"), _cache(micro, url) as cache:
        _, cold = _run(cache, ids)
        s, out = _run(cache, ids)
    assert (s.provenance.device_tokens, s.provenance.window_source, s.provenance.replayed_tokens) == (
        60,
        "replay",
        W,
    )
    assert _close(cold, out)
    c = cache.stats.swa_pool
    assert c.backend_errors >= 1 and c.hits == 0 and cache.stats.snapshots_stored == 0
    assert [r.getMessage().split(": ", 1)[1][:25] for r in caplog.records] == ["unreachable at start-up ("]


def test_keys_lost_between_the_manifest_and_the_chunks_is_a_replay(micro, tmp_path, monkeypatch) -> None:
    """The window snapshot's chunks go (evicted or expired) after its manifest was read: the restore plan
    sees a miss and replays; the pool counts one eviction; no error."""
    ids = _ids(61, seed=3)
    with RedisServer(tmp_path) as server, _cache(micro, server.url) as cache:
        _, cold = _run(cache, ids)
        client, raw = cache.swa_pool._servers[0].client, redis.Redis(port=server.port)
        real, made = client.pipeline, []

        def pipeline(**kw):
            pipe = real(**kw)
            made.append(pipe)
            if len(made) == 2:  # the chunk round trip of the lookup: the chunks vanish just before it
                execute = pipe.execute

                def late_execute(*a, **k):
                    raw.delete(*[k for k in raw.scan_iter("kvdiet:swa:*") if not k.endswith(b":m")])
                    return execute(*a, **k)

                pipe.execute = late_execute
            return pipe

        monkeypatch.setattr(client, "pipeline", pipeline)
        s, out = _run(cache, ids)
        assert (s.provenance.window_source, s.provenance.replayed_tokens) == ("replay", W)
        assert _close(cold, out)
        c = cache.stats.swa_pool
        assert (c.evictions, c.corrupt_dropped, c.backend_errors, c.hits) == (1, 0, 0, 0)
        raw.close()


# --- processes ---


def _generate_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(["generate", "--model", "v4.1-micro", "--max-tokens", "3", "--block-size", "4", *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_two_processes_share_snapshots_and_continue_exactly(tmp_path: Path, capsys) -> None:
    """This process finishes a prompt; another process, given the prompt + its output + one more token,
    gets the global KV from the shared persistent directory and the window state at 60 from Redis, and
    produces exactly the tokens of a run without any cache."""
    prompt = [i % 64 for i in range(1, 61)]
    flags = ["--json", "--no-decoder-replay"]
    with RedisServer(tmp_path / "redis") as server:
        shared = ["--persistent-dir", str(tmp_path / "kv"), "--swa-pool", server.url]
        a = _generate_json(["--prompt-ids", ",".join(map(str, prompt)), *flags, *shared], capsys)
        assert a["cache_stats"]["swa_pool"]["entries_written"] == 2  # at 56 (prompt) and 60 (finish)
        follow = ",".join(map(str, [*prompt, *a["output_ids"], 7]))
        cmd = [*KVDIET, "generate", "--model", "v4.1-micro", "--max-tokens", "3", "--block-size", "4"]
        proc = subprocess.run(
            [*cmd, "--prompt-ids", follow, *flags, *shared], capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr
        b = json.loads(proc.stdout)
    cold = _generate_json(["--prompt-ids", follow, *flags], capsys)
    p = b["provenance"]
    assert (p["persistent_tokens"], p["window_source"], p["replayed_tokens"], p["exact"]) == (
        60,
        "swa-pool",
        0,
        True,
    )
    assert b["cache_stats"]["swa_pool"]["hits"] == 1 and b["cache_stats"]["swa_pool"]["backend_errors"] == 0
    assert cold["provenance"]["hit_tokens"] == 0 and b["output_ids"] == cold["output_ids"]


def _metric(text: str, name: str) -> float:
    m = re.search(rf'^kvdiet:{name}\{{model_name="v4.1-micro",tier="swa_pool"\}} (\S+)$', text, re.M)
    assert m is not None, name
    return float(m.group(1))


@pytest.mark.slow
def test_serve_with_redis_down_at_start_up_then_back(tmp_path: Path) -> None:
    port, redis_port = free_port(), free_port()
    log = tmp_path / "serve.log"
    cmd = [*KVDIET, "serve", "--model", "v4.1-micro", "--port", str(port), "--block-size", "4"]
    cmd += ["--kv-cache-memory", "1MiB", "--persistent-dir", "none"]
    cmd += ["--swa-pool", f"redis://127.0.0.1:{redis_port}/0", "--log-level", "warning"]
    base = f"http://127.0.0.1:{port}"
    body = {"model": "v4.1-micro", "prompt": list(range(1, 20)), "max_tokens": 2}
    server = RedisServer(tmp_path / "redis", port=redis_port)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not _up(base):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)

        def window() -> str:
            req = urllib.request.Request(
                f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.load(r)["usage"]["prompt_tokens_details"]["window_source"]

        assert [window(), window()] == ["none", "replay"]  # Redis down: served, window replayed
        metrics = _get(f"{base}/metrics")
        assert _metric(metrics, "cache_backend_errors_total") >= 1
        assert _metric(metrics, "cache_write_errors_total") >= 1
        server.start()
        time.sleep(1.2)  # past the 1 s back-off
        body["prompt"] = list(range(21, 40))  # (a replayed window is approximate: never stored)
        assert [window(), window()] == ["none", "swa-pool"]  # stored once Redis is back, then restored
        # /metrics reads the engine loop's snapshot, refreshed every 0.25 s: wait for the refresh
        deadline = time.monotonic() + 10
        while (
            _metric(_get(f"{base}/metrics"), "prefix_cache_hits_total") != W and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        assert _metric(_get(f"{base}/metrics"), "prefix_cache_hits_total") == W
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        server.stop()
    text = log.read_text()
    assert text.count("unreachable at start-up") == 1 and text.count("WARNING") == 1, text
    assert "Traceback" not in text


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _up(base: str) -> bool:
    try:
        return _get(f"{base}/health") is not None
    except OSError:
        return False
