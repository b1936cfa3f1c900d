"""`kvdiet generate` with the cache system: a second process hits the first one's persistent tier."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvdiet.cli import main

PROMPT = ",".join(str(i % 64) for i in range(1, 61))


def _generate(*extra: str) -> dict:
    cmd = [sys.executable, "-m", "kvdiet.cli", "generate", "--model", "v4.1-micro", "--prompt-ids", PROMPT]
    out = subprocess.run(
        [*cmd, "--max-tokens", "3", "--block-size", "4", "--json", *extra],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return json.loads(out.stdout)


def test_second_process_gets_a_persistent_hit_and_replays_the_window(tmp_path) -> None:
    first = _generate("--persistent-dir", str(tmp_path))
    second = _generate("--persistent-dir", str(tmp_path))
    assert (
        first["provenance"]["hit_tokens"] == 0 and first["cache_stats"]["persistent"]["entries_written"] == 15
    )
    p = second["provenance"]
    assert (p["persistent_tokens"], p["window_source"], p["replayed_tokens"], p["computed_tokens"]) == (
        56,
        "replay",
        8,
        4,
    )
    assert second["cache_stats"]["persistent"]["hit_tokens"] == 56
    # a snapshot policy persists the window too: a third process restores it exactly
    _generate("--persistent-dir", str(tmp_path), "--swa-policy", "checkpoint:8")
    third = _generate("--persistent-dir", str(tmp_path), "--swa-policy", "checkpoint:8")["provenance"]
    assert (third["window_source"], third["replayed_tokens"], third["exact"]) == ("persistent", 0, True)


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [
        ("--swa-policy", "lru", "unknown SWA policy"),
        ("--swa-policy", "checkpoint:6", "multiple of the block size"),
        ("--persistent-ttl", "soon", "cannot parse duration"),
        ("--kv-cache-memory", "10B", "below one block"),
        ("--block-size", "3", "multiple of every compress ratio"),
        ("--block-size", "0", "multiple of every compress ratio [1, 2]"),
        ("--max-tokens", "1000000000", "> max_position_embeddings 256"),  # checked before any allocation
        ("--kv-cache-memory", "500", "blocks"),  # one 4-token block: the pool runs out while decoding
        ("--prompt-ids", "99999999999999999999", "outside the vocabulary [0, 64)"),
    ],
)
def test_bad_cache_flags_exit_2_with_one_line(capsys, tmp_path, flag, value, needle) -> None:
    argv = ["generate", "--model", "v4.1-micro", "--prompt-ids", "1,2,3", "--block-size", "4"]
    argv += ["--persistent-dir", str(tmp_path), flag, value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1
