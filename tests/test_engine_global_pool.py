"""The shared global-KV DRAM tier through ``kvdiet generate`` processes (v4.1-micro, a real mooncake_master and a
standalone segment holder): a second process continues the first's prompt with global KV from the global pool
(no persistent directory, or an empty one, of its own) and window state from the Mooncake SWA pool, producing
the tokens of a run without any cache; a master that is down only makes misses."""

from __future__ import annotations

from pathlib import Path

import pytest

from mooncake_helpers import MooncakeMaster, SegmentHolder
from pool_engine_helpers import generate_here, generate_process
from redis_helpers import free_port

PROMPT = [i % 64 for i in range(1, 61)]  # 15 blocks of 4 tokens
FLAGS = ["--json", "--no-decoder-replay"]


_generate = generate_process
_generate_here = generate_here


def _ids(tokens: list[int]) -> list[str]:
    return ["--prompt-ids", ",".join(map(str, tokens))]


@pytest.mark.slow
def test_a_second_process_continues_from_the_global_pool_exactly(tmp_path: Path, capsys) -> None:
    with MooncakeMaster(tmp_path / "mc") as master, SegmentHolder(tmp_path / "mc", master):
        pools = ["--swa-pool", master.url, "--swa-pool-size", "0", "--global-pool", master.url]
        pools += ["--global-pool-size", "0"]
        a = _generate([*_ids(PROMPT), *FLAGS, *pools, "--persistent-dir", str(tmp_path / "kv-a")])
        # 60 prompt + 2 fed output tokens: 15 full blocks, written through to the disk and the global pool
        assert a["cache_stats"]["global_pool"]["entries_written"] == 15
        assert a["cache_stats"]["persistent"]["entries_written"] == 15
        follow = [*PROMPT, *a["output_ids"], 7]  # 64 tokens: blocks 0..14 are the first run's
        b = _generate([*_ids(follow), *FLAGS, *pools])  # no persistent tier at all
        empty = tmp_path / "kv-c"
        c = _generate([*_ids(follow), *FLAGS, *pools, "--persistent-dir", str(empty)])
    cold = _generate_here([*_ids(follow), *FLAGS], capsys)
    for run in (b, c):
        p = run["provenance"]
        assert (p["device_tokens"], p["global_pool_tokens"], p["persistent_tokens"], p["hit_tokens"]) == (
            0,
            60,
            0,
            60,
        )
        assert (p["window_source"], p["replayed_tokens"], p["exact"]) == ("swa-pool", 0, True)
        g = run["cache_stats"]["global_pool"]
        assert (g["query_tokens"], g["hit_tokens"], g["hits"], g["corrupt_dropped"], g["backend_errors"]) == (
            60,
            60,
            15,
            0,
            0,
        )
        assert run["output_ids"] == cold["output_ids"]
    assert cold["provenance"]["hit_tokens"] == 0
    # the empty directory now holds this machine's durable copy: the 15 blocks hit, and the one computed
    assert c["cache_stats"]["persistent"]["entries_written"] == 16
    assert c["cache_stats"]["persistent"]["query_tokens"] == 0  # the global pool answered the whole run


@pytest.mark.slow
def test_master_down_means_misses_and_the_run_completes_with_correct_tokens(tmp_path: Path, capsys) -> None:
    down = ["--global-pool", f"mooncake://127.0.0.1:{free_port()}", "--global-pool-size", "0"]
    cold = _generate_here([*_ids(PROMPT), *FLAGS], capsys)
    run = _generate([*_ids(PROMPT), *FLAGS, *down, "--persistent-dir", str(tmp_path / "kv")])
    assert run["output_ids"] == cold["output_ids"] and run["provenance"]["hit_tokens"] == 0
    g = run["cache_stats"]["global_pool"]
    assert g["backend_errors"] >= 1 and g["write_errors"] == 15 and g["hits"] == 0
    assert run["cache_stats"]["persistent"]["entries_written"] == 15  # the disk tier works on
    again = _generate([*_ids([*PROMPT, 9]), *FLAGS, *down, "--persistent-dir", str(tmp_path / "kv")])
    p = again["provenance"]
    assert (p["global_pool_tokens"], p["persistent_tokens"]) == (0, 60)  # the disk continues the run alone
    assert again["cache_stats"]["global_pool"]["query_tokens"] == 60
    assert again["cache_stats"]["global_pool"]["hit_tokens"] == 0
