"""``kvdiet replay`` in model-free mode: the table, --json (deterministic), --report, and flag errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvdiet.cli import main


def _trace(path: Path, n: int = 200, seed: int = 3) -> Path:
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        conv = rng.randrange(15)
        depth = rng.randrange(1, 5)
        ids = [conv * 100 + k for k in range(depth)]
        lines.append(
            json.dumps(
                {
                    "timestamp": i * 900,
                    "input_length": depth * 512 - rng.randrange(300),
                    "output_length": rng.randrange(1, 700),
                    "hash_ids": ids,
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def test_model_free_json_is_deterministic_and_the_report_is_written(tmp_path: Path, capsys) -> None:
    trace = _trace(tmp_path / "t.jsonl")
    argv = [
        "replay",
        str(trace),
        "--json",
        "--sweep",
        "swa-pool-ttl=30s,5m",
        "--sweep",
        "device-size=1GB,8GB",
    ]
    assert main([*argv, "--jobs", "1"]) == 0
    first = capsys.readouterr().out
    assert main([*argv, "--jobs", "2", "--report", str(tmp_path / "out")]) == 0
    second = json.loads(capsys.readouterr().out)
    second.pop("report")
    assert json.loads(first) == second
    runs = {r["label"]: r for r in second["runs"]}
    assert len(runs) == 7 and "boundary-snapshot @ deepseek-v4-flash" in runs
    v41 = runs["bounded-replay @ deepseek-v4.1-flash"]["summary"]
    v4 = runs["boundary-snapshot @ deepseek-v4-flash"]["summary"]
    f = second["findings"]
    assert f["persistent_ratio_v41_over_v4"] == round(
        v41["persistent_bytes_resident"] / v4["persistent_bytes_resident"], 4
    )
    assert 0 < f["persistent_ratio_v41_over_v4"] < 0.26  # at most the global-KV ratio 890 / 3514.25
    assert [p["value"] for p in second["sweeps"]["swa-pool-ttl"]] == ["30s", "5m", "unbounded"]
    assert [p["config"]["device_bytes"] for p in second["sweeps"]["device-size"]] == [10**9, 8 * 10**9]
    out = tmp_path / "out"
    for name in (
        "hit_rate_over_time",
        "persistent_bytes",
        "recomputed_tokens",
        "swa_pool_ttl",
        "sweep_device-size",
    ):
        assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    md = (out / "report.md").read_text()
    assert "## Policy comparison" in md and "GPU-seconds = FLOPs / (H200" in md and "## Findings" in md


def test_the_table_is_printed(tmp_path: Path, capsys) -> None:
    trace = _trace(tmp_path / "t.jsonl", n=40)
    assert main(["replay", str(trace), "--runs", "bounded-replay,exact-recompute", "--sweep", "none"]) == 0
    out = capsys.readouterr().out
    assert "policy comparison" in out and "bounded-replay@v4.1-flash" in out and "exact-recompute" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--runs", "lru"], "unknown SWA policy"),
        (["--runs", "bounded-replay@no-such-model"], "no-such-model"),
        (["--sweep", "pool=1"], "AXIS=V1,V2"),
        (["--sweep", "swa-pool-ttl=soon"], "soon"),
        (["--gpu", "tpu"], "unknown GPU"),
        (["--mfu", "0"], "MFU"),
        (["--device-size", "lots"], "lots"),
        (["--runs", "checkpoint:1000", "--sweep", "none"], "multiple of the trace's block size"),
        (["--jobs", "0"], "--jobs"),
    ],
)
def test_bad_flags_exit_2_with_one_line(tmp_path: Path, capsys, flags: list[str], message: str) -> None:
    trace = _trace(tmp_path / "t.jsonl", n=5)
    assert main(["replay", str(trace), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvdiet replay: error: ") and message in err
