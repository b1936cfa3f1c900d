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
    assert f["persistent_ratio_basis"] == "peak bytes"
    assert f["persistent_ratio_v41_over_v4"] == round(
        v41["persistent_bytes_peak"] / v4["persistent_bytes_peak"], 4
    )
    assert f["persistent_ratio_written"] == round(
        v41["persistent_bytes_written"] / v4["persistent_bytes_written"], 4
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
    assert "{" not in md and "| input_tokens: total | " in md  # nested figures as rows, no raw dicts
    assert "persistent unbounded TTL 72 h" in md and "SWA pool 200.00 GB TTL 5 min" in md
    # every run split by context regime (the trace's prompts are all ≤ 32K), no kind in this trace
    assert "## Policy comparison by context-length regime" in md and "by traffic kind" not in md
    assert md.count("| ≤32K |") == len(second["runs"])
    # global KV only, written at the same times, under exact-recompute and both checkpoints: one line, noted
    assert (
        "Identical lines, each drawn once: checkpoint:4096 @ deepseek-v4.1-flash = checkpoint:16384 @ "
        "deepseek-v4.1-flash = exact-recompute @ deepseek-v4.1-flash." in md
    )


def test_json_is_strict_and_non_finite_numbers_become_null(tmp_path: Path, capsys) -> None:
    from kvdiet.sim.command import _finite

    assert _finite({"a": [1.5, float("nan")], "b": {"c": float("inf")}, "d": "x"}) == {
        "a": [1.5, None],
        "b": {"c": None},
        "d": "x",
    }
    assert main(["replay", str(_trace(tmp_path / "t.jsonl", n=5)), "--mode", "stats", "--json"]) == 0

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in --json output")

    assert json.loads(capsys.readouterr().out, parse_constant=refuse)["trace"]["requests"] == 5


def test_a_failed_run_creates_no_report_dir_and_most_lines_skipped_exits_2(tmp_path: Path, capsys) -> None:
    path = tmp_path / "t.jsonl"
    good = {"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}
    path.write_text("\n".join([json.dumps(good), "{broken", '{"timestamp": Infinity}']) + "\n")
    out = tmp_path / "out"
    assert main(["replay", str(path), "--report", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvdiet replay: error: {path}: 2 of 3 lines malformed, so the trace is refused")
    assert "line 2: " in err and "line 3: " in err and err.count("\n") == 1
    assert not out.exists()
    (tmp_path / "file").write_text("")
    assert main(["replay", str(path), "--report", str(tmp_path / "file" / "out")]) == 2
    assert "is not a writable directory" in capsys.readouterr().err
    # where access() lets root write and the file system does not: refused before the run, naming the flag
    # (was "[Errno 2] No such file or directory: '/proc/kvdiet-x'" once the runs were done)
    assert main(["replay", str(path), "--report", "/proc/kvdiet-x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvdiet replay: error: --report /proc/kvdiet-x: ") and err.count("\n") == 1
    assert "/proc does not take a new folder" in err  # not "cannot make a folder in /proc (no such file...)"
    assert not list(tmp_path.glob(".kvdiet-report-check-*"))


def test_the_engine_table_keeps_its_chosen_columns() -> None:
    from kvdiet.sim.report import ENGINE_COLUMNS, engine_row

    summary = {
        "model": "v4.1-mini",
        "policy": "bounded-replay",
        "requests": 3,
        "device_hit_ratio": 0.25,
        "persistent_hit_ratio": 0.5,
        "window_sources": {"swa-pool": 1, "none": 2},
        "replayed_tokens": 1280,
        "computed_tokens": 40,
        "ttft_p50_s": 1.23456,
        "ttft_p90_s": None,
        "model_free_agreeing": 3,
        "persistent_bytes_written": 1_234_567,
        "model_free_persistent_bytes_written": 1_200_000,
    }
    assert list(engine_row(summary).values()) == [
        "bounded-replay@v4.1-mini",
        "3",
        "25.0%",
        "50.0%",
        "swa-pool: 1, none: 2",
        "1,280",
        "40",
        "1.235 s",
        "-",
        "3",
        "1.23 MB",
        "1.20 MB",
    ]
    assert len(ENGINE_COLUMNS) == 12
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    assert "engine-mode table keeps twelve columns (run," in readme  # the README counts them as the code does


def test_empty_hit_windows_are_gaps_and_identical_lines_are_grouped() -> None:
    import math

    from kvdiet.sim.plots import hit_gaps, identical_lines

    # buckets end at 0, 10, 20, 30 s; arrivals at 0, 5, 25 s: the bucket (10, 20] is empty
    gaps = hit_gaps([0.5, 0.0, 0.0, 1.0], [0.0, 10.0, 20.0, 30.0], [25.0, 0.0, 5.0])
    assert gaps[:2] == [0.5, 0.0] and math.isnan(gaps[2]) and gaps[3] == 1.0
    groups = identical_lines([("a", [1, 2]), ("b", [1, 3]), ("c", [1, 2])])
    assert groups == [(["a", "c"], [1, 2]), (["b"], [1, 3])]


def test_the_table_is_printed(tmp_path: Path, capsys) -> None:
    trace = _trace(tmp_path / "t.jsonl", n=40)
    assert main(["replay", str(trace), "--runs", "bounded-replay,exact-recompute", "--sweep", "none"]) == 0
    out = capsys.readouterr().out
    assert "policy comparison" in out and "bounded-replay@deepseek-v4.1-flash" in out
    assert "exact-recompute@deepseek-v4.1-flash" in out


def test_every_run_name_the_table_and_json_show_is_taken_back_by_runs(tmp_path: Path, capsys) -> None:
    """The table printed ``boundary-snapshot@v4-flash``, which --runs refused ('v4-flash' is neither a preset);
    each name the table or --json (``label``) shows for the default runs now gives back the same run."""
    trace = _trace(tmp_path / "t.jsonl", n=30)
    argv = ["replay", str(trace), "--sweep", "none", "--jobs", "1"]
    assert main([*argv, "--json"]) == 0
    default = json.loads(capsys.readouterr().out)["runs"]
    assert main(argv) == 0
    table = [
        line.split("│")[1].strip() for line in capsys.readouterr().out.splitlines() if line.startswith("│")
    ]
    labels = [r["label"] for r in default]
    assert table[0] == "boundary-snapshot@deepseek-v4-flash"  # was boundary-snapshot@v4-flash
    assert labels[0] == "boundary-snapshot @ deepseek-v4-flash"
    assert len(table) == len(labels) == 7
    for names in (table, labels):
        assert main([*argv, "--json", "--runs", ",".join(names)]) == 0
        assert json.loads(capsys.readouterr().out)["runs"] == default


def test_a_global_pool_adds_its_column_to_the_tables_and_the_report(tmp_path: Path, capsys) -> None:
    trace = _trace(tmp_path / "t.jsonl", n=40)
    argv = [
        "replay",
        str(trace),
        "--runs",
        "bounded-replay",
        "--sweep",
        "global-pool-ttl=1m,1h",
        "--jobs",
        "1",
    ]
    report = tmp_path / "report"
    assert main([*argv, "--global-pool-size", "10GB", "--device-size", "1GB", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "global pool" in out and "sweep global-pool-ttl" in out
    md = (report / "report.md").read_text()
    assert "| global pool |" in md and "global pool 10.00 GB TTL 1 h" in md
    assert main([*argv[:4], "--sweep", "none", "--json", "--global-pool-size", "10GB"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    assert run["config"]["global_pool_bytes"] == 10 * 10**9 and "global_pool_hit_ratio" in run["summary"]
    assert main([*argv[:4], "--sweep", "none"]) == 0
    assert "global pool" not in capsys.readouterr().out  # off by default: the tables are unchanged


def test_progress_goes_to_a_log_as_lines_off_a_terminal(tmp_path: Path, capsys) -> None:
    trace = _trace(tmp_path / "t.jsonl", n=12)
    argv = ["replay", str(trace), "--runs", "bounded-replay,exact-recompute", "--sweep", "none"]
    assert main([*argv, "--progress-interval", "0", "--jobs", "1"]) == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("replaying")]
    assert [x.split(" (")[0] for x in lines] == [
        "replaying 12 requests 1/2 runs",
        "replaying 12 requests 2/2 runs",
    ]
    assert main([*argv, "--jobs", "1"]) == 0  # shorter than the default 10 s: no line
    assert "replaying" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--progress-interval", "-1"], "--progress-interval must be >= 0 seconds"),
        (["--runs", "lru"], "--runs: unknown SWA policy"),
        (["--mode", "engine", "--runs", "lru"], "--runs: unknown SWA policy"),
        (["--runs", "bounded-replay@no-such-model"], "--runs: 'no-such-model' is neither a preset"),
        (["--model", "no-such-model"], "--model: 'no-such-model' is neither a preset"),
        (["--sweep-run", "lru"], "--sweep-run: unknown SWA policy"),
        (["--mode", "engine", "--engine-model", "nope"], "--engine-model: 'nope' is neither a preset"),
        (["--sweep", "pool=1"], "AXIS=V1,V2"),
        (["--sweep", "swa-pool-ttl=soon"], "soon"),
        (["--gpu", "tpu"], "--gpu: unknown GPU 'tpu'"),
        (["--mfu", "0"], "--mfu: MFU must be in (0, 1]"),
        (["--device-size", "lots"], "lots"),
        (["--runs", "checkpoint:1000", "--sweep", "none"], "run checkpoint:1000@"),
        (["--jobs", "0"], "--jobs"),
        (["--mode", "engine", "--max-requests", "-2"], "--max-requests must be an integer >= 1, got -2"),
        (["--max-requests", "200"], "--max-requests: engine mode only"),  # the model-free study ignored it
        (["--mode", "engine", "--time-scale", "-1"], "--time-scale must be a finite number >= 0"),
        (["--mode", "engine", "--time-scale", "nan"], "--time-scale must be a finite number >= 0, got nan"),
        (["--mode", "engine", "--max-num-seqs", "0"], "--max-num-seqs must be an integer >= 1, got 0"),
        (["--time-scale", "-1"], "--time-scale: engine mode only (--mode engine)"),  # before its value
        (["--mode", "engine", "--runs", "checkpoint:100@v4-mini"], "multiple of the engine block size 128"),
        (
            ["--mode", "engine", "--runs", "bounded-replay@v4-mini", "--engine-block-size", "16"],
            "for v4-mini",
        ),
        (["--output-tok-s", "0"], "--output-tok-s must be a finite number > 0"),
        (["--device-size", "0"], "--device-size must be > 0 bytes"),
        (["--swa-pool-ttl", "abc"], "--swa-pool-ttl: cannot parse duration 'abc'"),
        (["--persistent-size", "-1GB"], "--persistent-size: "),
        (["--sweep", "swa-pool-ttl=abc"], "--sweep: cannot parse duration 'abc'"),
        (["--sweep", "none", "--sweep", "swa-pool-ttl=1m"], "cannot be combined with another --sweep"),
        (["--runs", "bounded-replay,exact-recompute,bounded-replay"], "--runs: bounded-replay given twice"),
        (["--runs", "bounded-replay,,full-store"], "--runs: item 2 is empty (runs are comma-separated)"),
        (
            ["--mode", "engine", "--kv-cache-memory", "1000000GB"],
            "--kv-cache-memory: the KV cache needs ~1,000,000.0 GB",
        ),
        (["--global-pool-size", "-1GB"], "--global-pool-size: "),
        (["--global-pool-ttl", "0s"], "--global-pool-ttl: duration must be > 0"),
        (["--threads", "0"], "--threads must be between 1 and"),  # refused in model-free mode too
        (["--threads", "100000"], "--threads must be between 1 and"),  # OpenMP crashed on it
    ],
)
def test_bad_flags_exit_2_with_one_line(tmp_path: Path, capsys, flags: list[str], message: str) -> None:
    trace = _trace(tmp_path / "t.jsonl", n=5)
    assert main(["replay", str(trace), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvdiet replay: error: ") and message in err


@pytest.mark.parametrize(
    ("sweep", "message"),
    [
        ("device-size=8GB,0", "--sweep 'device-size=8GB,0': device-size must be > 0 bytes, got '0'"),
        ("swa-pool-size=0", "--sweep 'swa-pool-size=0': swa-pool-size must be > 0 bytes, got '0'"),
        ("swa-pool-ttl=5m,300s", "--sweep 'swa-pool-ttl=5m,300s': '300s' is '5m' again"),
        ("device-size=8GB,unbounded", "byte size 'unbounded': this one needs a bound (examples: 4GiB"),
        ("persistent-ttl=unbounded", "duration 'unbounded': this one needs a bound (examples: 72h"),
    ],
)
def test_a_bad_sweep_value_is_refused_before_the_trace_is_read(capsys, sweep: str, message: str) -> None:
    # a missing trace: the sweep's error comes first (a size of 0 was refused after the trace was read, in
    # words naming no flag; a value given twice ran the same point twice)
    assert main(["replay", "no-such-trace.jsonl", "--sweep", sweep]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"kvdiet replay: error: --sweep: {message}" or (
        "unbounded" in sweep and err.startswith("kvdiet replay: error: ") and message in err
    ), err


def test_unbounded_is_the_default_where_the_default_is_unbounded(tmp_path: Path, capsys) -> None:
    """``--persistent-size unbounded`` and ``--sweep swa-pool-ttl=30s,unbounded`` were "cannot parse"; the word
    (any case) is exactly the default: the persistent tier without a size, the TTL sweep's own last point."""
    trace = _trace(tmp_path / "t.jsonl", n=40)
    argv = ["replay", str(trace), "--runs", "bounded-replay", "--json", "--jobs", "1"]
    assert main([*argv, "--sweep", "none"]) == 0
    default = json.loads(capsys.readouterr().out)["runs"]
    assert main([*argv, "--sweep", "none", "--persistent-size", "Unbounded"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"] == default
    assert default[0]["config"]["persistent_bytes"] is None
    assert main([*argv, "--sweep", "swa-pool-ttl=30s,1m"]) == 0
    plain = json.loads(capsys.readouterr().out)["sweeps"]["swa-pool-ttl"]
    assert [p["value"] for p in plain] == ["30s", "1m", "unbounded"]
    for spelled in ("30s,1m,unbounded", "UNBOUNDED,30s,1m"):  # the unbounded point is last, once
        assert main([*argv, "--sweep", f"swa-pool-ttl={spelled}"]) == 0
        assert json.loads(capsys.readouterr().out)["sweeps"]["swa-pool-ttl"] == plain
    assert main([*argv, "--sweep", "persistent-size=1MB,unbounded"]) == 0
    points = json.loads(capsys.readouterr().out)["sweeps"]["persistent-size"]
    assert [(p["value"], p["config"]["persistent_bytes"]) for p in points] == [
        ("1MB", 10**6),
        ("unbounded", None),
    ]
    assert points[1]["summary"] == default[0]["summary"]
    assert main([*argv, "--sweep", "none", "--swa-pool-ttl", "unbounded"]) == 2
    assert capsys.readouterr().err == (
        "kvdiet replay: error: --swa-pool-ttl: duration 'unbounded': this one needs a bound (examples: 72h, 5m, "
        "30s, 250ms, 90); 'unbounded' is taken only where it is the default\n"
    )


def test_one_run_spelled_two_ways_is_refused_as_a_run_given_twice(capsys) -> None:
    # the default model named or not: the same run, which was replayed and listed twice
    runs = "bounded-replay@deepseek-v4.1-flash,full-store,bounded-replay"
    assert main(["replay", "no-such-trace.jsonl", "--runs", runs]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvdiet replay: error: --runs: bounded-replay is bounded-replay@deepseek-v4.1-flash again"
    )


def test_a_missing_trace_is_one_line(capsys) -> None:
    assert main(["replay", "no-such-trace.jsonl"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvdiet replay: error: no-such-trace.jsonl: no such trace file or folder"
    )


def test_report_tables_escape_a_pipe_in_a_label() -> None:
    from kvdiet.sim.report import _table

    row = _table([{"kind": "chat|tools", "requests": 3}]).splitlines()[2]
    assert row == "| chat\\|tools | 3 |"
    # a session id with a line break (a session file's id is any string) split the row in two
    lines = _table([{"session": "a\nb\tc ✓", "requests": 3}]).splitlines()
    assert len(lines) == 3 and lines[2] == "| a\\nb\\tc ✓ | 3 |"


def test_requests_past_the_models_context_are_simulated_with_one_warning(tmp_path: Path, capsys) -> None:
    path = tmp_path / "long.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,1048000,1000\n"  # 1,049,000 tokens: past 1,048,576 (2**20)
        "2023-11-16 18:15:50.9951690,1048000,576\n"  # exactly 2**20: fits
    )
    assert main(["replay", str(path), "--runs", "bounded-replay", "--sweep", "none", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["runs"][0]["summary"]["requests"] == 2  # simulated all the same
    assert err.strip() == (  # was silent: a trace of another model's contexts read as this one's
        "kvdiet replay: warning: 1 of 2 requests (the longest 1,049,000 tokens, prompt and output) run past "
        "deepseek-v4.1-flash's max_position_embeddings 1,048,576: simulated all the same, the bytes "
        "extrapolated; the model serves no context that long"
    )


def test_a_report_of_requests_that_store_nothing_draws_its_plots_without_a_warning(
    tmp_path: Path, capsys, recwarn
) -> None:
    path = tmp_path / "empty.jsonl"  # empty prompts: nothing is ever stored, every bytes line is 0
    path.write_text('{"timestamp": 0, "input_length": 0, "output_length": 0, "hash_ids": []}\n' * 2)
    flags = ["--runs", "bounded-replay", "--sweep", "none", "--report", str(tmp_path / "out"), "--json"]
    assert main(["replay", str(path), *flags]) == 0
    assert (tmp_path / "out" / "persistent_bytes.png").stat().st_size > 0
    # was matplotlib's "Data has no positive values, and therefore cannot be log-scaled" on stderr
    assert not [w for w in recwarn if "log-scaled" in str(w.message)]


@pytest.mark.parametrize(("block", "note"), [(64, True), (100, True), (512, False)])
def test_a_model_run_at_other_blocks_than_the_traces_says_so_in_one_line(
    tmp_path: Path, capsys, block: int, note: bool
) -> None:
    """V4-Flash runs at multiples of 128 tokens: a 64-token trace at 128, a 100-token one at 3,200 (was 100:
    10.0-MB snapshots between HCA groups, silently); Mooncake's 512 as they are. One line per model."""
    path = tmp_path / "g.jsonl"
    head = {"format": "kvdiet-trace", "version": 1, "block_size": block}
    rows = [
        {"arrival_s": t, "input_length": 4000, "output_length": 9, "hash_ids": list(range(-(-4000 // block)))}
        for t in (0.0, 5.0)
    ]
    path.write_text("\n".join(json.dumps(x) for x in [head, *rows]) + "\n")
    runs = "boundary-snapshot@deepseek-v4-flash,full-store@deepseek-v4-flash,bounded-replay"
    assert main(["replay", str(path), "--runs", runs, "--sweep", "none", "--json"]) == 0
    out, err = capsys.readouterr()
    at = {64: 128, 100: 3200, 512: 512}[block]
    lines = [line for line in err.splitlines() if "runs at" in line]
    assert lines == (
        [
            f"kvdiet replay: deepseek-v4-flash runs at {at:,}-token blocks (the trace's {block}-token blocks, "
            f"{at // block} to a block)"
        ]
        if note
        else []
    )
    summaries = [r["summary"] for r in json.loads(out)["runs"]]
    assert [s["block_size"] for s in summaries] == [at, at, block]
    v4 = summaries[0]
    assert v4["persistent_window_bytes_written"] == v4["snapshots_stored"] * 4_118_872 > 0


def _whole_tables(text: str, headers: list[str]) -> None:
    """Every box-drawn row of ``text`` ends in its closing border (not cropped) and every header is whole
    on one line (not wrapped)."""
    closing = {"┏": "┓", "┃": "┃", "┡": "┩", "│": "│", "└": "┘"}
    rows = [line for line in text.splitlines() if line[:1] in closing]
    assert rows and all(line.endswith(closing[line[0]]) for line in rows), rows
    head = [line for line in rows if line.startswith("┃")]
    for name in headers:
        assert any(f" {name} " in line for line in head), name


def test_off_a_terminal_every_table_prints_whole_whatever_columns_says(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    from kvdiet.sim import engine_mode
    from kvdiet.sim.report import ENGINE_COLUMNS

    summary = {
        "model": "v4.1-mini",
        "policy": "bounded-replay",
        "requests": 4,
        "device_hit_ratio": 0.25,
        "persistent_hit_ratio": 0.5,
        "window_sources": {"swa-pool": 1, "none": 3},
        "replayed_tokens": 1280,
        "computed_tokens": 40,
        "ttft_p50_s": 1.23456,
        "ttft_p90_s": 20.5,
        "model_free_agreeing": 4,
        "persistent_bytes_written": 1_234_567,
        "model_free_persistent_bytes_written": 1_200_000,
    }

    class _Run:
        ttft_s = (1.0,)

        def summary(self) -> dict[str, object]:
            return summary

    monkeypatch.setattr(engine_mode, "run_engine_mode", lambda trace, cfg, progress: _Run())
    trace = _trace(tmp_path / "t.jsonl", n=40)
    for columns in ("60", "400"):
        monkeypatch.setenv("COLUMNS", columns)
        argv = [
            "replay",
            str(trace),
            "--mode",
            "engine",
            "--max-requests",
            "4",
            "--runs",
            "bounded-replay@v4.1-mini",
        ]
        assert main(argv) == 0
        _whole_tables(capsys.readouterr().out, list(ENGINE_COLUMNS))
        assert main(["replay", str(trace), "--runs", "bounded-replay", "--sweep", "swa-pool-ttl=30s,1m"]) == 0
        out = capsys.readouterr().out
        _whole_tables(
            out, ["run", "persistent peak", "window at peak", "recomputed", "GPU-s", "window restored"]
        )
        assert main(["replay", str(trace), "--mode", "stats"]) == 0
        stats = capsys.readouterr().out.splitlines()
        assert any(
            line.startswith("infinite_cache_hit_ratio_variants") and "mean_per_request" in line
            for line in stats
        )
        assert main(["plan"]) == 0
        plan = capsys.readouterr().out
        _whole_tables(plan, ["recompute on hit (tokens)", "bytes/token", "+ window + tails"])
        assert any(
            line.startswith("Window state per request") and "compressor tails" in line
            for line in plan.splitlines()
        )
        assert main(["plan", "--compare", "deepseek-v4.1-flash", "deepseek-v4-flash"]) == 0
        _whole_tables(
            capsys.readouterr().out, ["figure", "deepseek-v4.1-flash", "deepseek-v4-flash", "a / b"]
        )


def test_the_report_says_which_model_ran_at_other_blocks_than_the_traces(tmp_path: Path, capsys) -> None:
    """report.md's trace table reads 64-token blocks while V4-Flash ran (and hit) at 128: the stderr line was
    the only word of it, and a report outlives the terminal."""
    path = tmp_path / "g.jsonl"
    head = {"format": "kvdiet-trace", "version": 1, "block_size": 64}
    rows = [
        {"arrival_s": t, "input_length": 4000, "output_length": 9, "hash_ids": list(range(63))}
        for t in (0.0, 5.0)
    ]
    path.write_text("\n".join(json.dumps(x) for x in [head, *rows]) + "\n")
    runs = "boundary-snapshot@deepseek-v4-flash,bounded-replay"
    argv = [
        "replay",
        str(path),
        "--runs",
        runs,
        "--sweep",
        "none",
        "--jobs",
        "1",
        "--report",
        str(tmp_path / "out"),
    ]
    assert main(argv) == 0
    capsys.readouterr()
    md = (tmp_path / "out" / "report.md").read_text()
    said = [line for line in md.splitlines() if "runs at" in line]
    assert said == [
        "- deepseek-v4-flash runs at 128-token blocks (the trace's 64-token blocks, 2 to a block): its hits, "
        "stores and snapshots are at its engine's block boundaries (`kvdiet.sim.reblock`)."
    ], said


ENGINE_ONLY_FLAGS = [
    ["--engine-model", "v4-mini"],
    ["--max-requests", "8"],
    ["--engine-block-size", "3"],
    ["--time-scale", "5"],
    ["--time-scale", "0"],  # its default value, given: still refused
    ["--kv-cache-memory", "1KB"],
    ["--max-num-seqs", "2"],
    ["--seed", "0"],
    ["--threads", "2"],
]


@pytest.mark.parametrize("mode", ["model-free", "stats"])
@pytest.mark.parametrize("flag", ENGINE_ONLY_FLAGS, ids=lambda f: f[0])
def test_an_engine_mode_flag_in_another_mode_is_refused_before_the_trace_is_read(
    capsys, mode: str, flag: list[str]
) -> None:
    """Each of these exited 0 in model-free mode, ignored without a word (only --max-requests was refused);
    a missing trace: the refusal comes before any reading."""
    assert main(["replay", "no-such-trace.jsonl", "--mode", mode, *flag]) == 2
    assert capsys.readouterr().err == (
        f"kvdiet replay: error: {flag[0]}: engine mode only (--mode engine); --mode {mode} does not use it\n"
    )


MODEL_FREE_ONLY_FLAGS = [
    ["--model", "deepseek-v4.1-flash"],  # its default value, given: still refused
    ["--device-size", "1GB"],
    ["--persistent-size", "1GB"],
    ["--swa-pool-supersede"],
    ["--global-pool-size", "1GB"],
    ["--global-pool-ttl", "1m"],
    ["--gpu", "h100"],
    ["--mfu", "0.3"],
    ["--output-tok-s", "20"],
    ["--sweep", "none"],
    ["--sweep-run", "full-store"],
    ["--jobs", "1"],
    ["--simcore", "off"],
]
RUN_FLAGS = [
    ["--runs", "bounded-replay"],
    ["--persistent-ttl", "1h"],
    ["--swa-pool-size", "1GB"],
    ["--swa-pool-ttl", "1m"],
    ["--progress-interval", "0"],
]


@pytest.mark.parametrize(
    ("mode", "flag", "said"),
    [("engine", f, "model-free mode only (the default --mode)") for f in MODEL_FREE_ONLY_FLAGS]
    + [("stats", f, "model-free mode only (the default --mode)") for f in MODEL_FREE_ONLY_FLAGS[:3]]
    + [("stats", f, "the model-free and engine modes only") for f in RUN_FLAGS],
    ids=lambda v: v[0] if isinstance(v, list) else v[:12],
)
def test_a_flag_of_another_mode_is_refused_before_the_trace_is_read(
    capsys, mode: str, flag, said: str
) -> None:
    """The model-free study's flags (tiers, cost model, sweeps, jobs) were ignored in engine mode, and every run
    flag in stats mode; each is refused by name, before the (missing) trace is read."""
    assert main(["replay", "no-such-trace.jsonl", "--mode", mode, *flag]) == 2
    assert (
        capsys.readouterr().err == f"kvdiet replay: error: {flag[0]}: {said}; --mode {mode} does not use it\n"
    )


def _replay_args(*flags: str):
    import argparse

    from kvdiet.device import add_device_arg
    from kvdiet.sim.command import add_replay_parser
    from kvdiet.threads import add_threads_arg

    rep = add_replay_parser(argparse.ArgumentParser().add_subparsers())
    add_threads_arg(rep)
    add_device_arg(rep)  # as kvdiet.cli adds them
    return rep.parse_args(["t.jsonl", *flags])


def test_engine_flags_keep_their_defaults_in_engine_mode_and_model_free_flags_are_not_refused() -> None:
    from kvdiet.sim.replay_flags import plan_runs

    (cfg,) = plan_runs(_replay_args("--mode", "engine"))  # parsed as None, the defaults the help names
    assert (cfg.model, cfg.max_requests, cfg.block_size, cfg.time_scale) == ("v4.1-mini", 8, 16, 0.0)
    assert (cfg.cache.kv_cache_memory, cfg.max_num_seqs, cfg.seed, cfg.device) == (2**30, 4, 0, "cpu")
    given = ["--engine-model", "v4-mini", "--time-scale", "5", "--kv-cache-memory", "1KB", "--seed", "3"]
    (cfg,) = plan_runs(_replay_args("--mode", "engine", *given, "--max-num-seqs", "2", "--max-requests", "3"))
    assert (cfg.model, cfg.max_requests, cfg.block_size, cfg.time_scale) == ("v4-mini", 3, 128, 5.0)
    assert (cfg.cache.kv_cache_memory, cfg.max_num_seqs, cfg.seed) == (1000, 2, 3)
    # the tier flags engine mode shares, and --device at its default, are model-free flags too
    shared = ["--persistent-ttl", "1h", "--swa-pool-size", "1GB", "--swa-pool-ttl", "1m", "--device", "cpu"]
    (run,), _ = plan_runs(_replay_args("--runs", "bounded-replay", "--sweep", "none", *shared))
    assert (run.persistent_ttl_s, run.swa_pool_bytes, run.swa_pool_ttl_s) == (3600.0, 10**9, 60.0)
    with pytest.raises(ValueError) as exc:  # a GPU for a mode that runs no model
        plan_runs(_replay_args("--device", "cuda"))
    assert str(exc.value) == "--device: engine mode only (--mode engine); --mode model-free runs no model"


@pytest.mark.parametrize(
    ("rate", "text"),
    [
        (0.0, "0.0 requests/s"),
        (1 / 23, "0.043 requests/s"),  # was 0.0
        (0.25, "0.25 requests/s"),
        (0.00012345, "0.00012 requests/s"),
        (1.0, "1.0 requests/s"),
        (1234.56, "1,234.6 requests/s"),
    ],
)
def test_a_slow_rate_keeps_two_significant_digits(rate: float, text: str) -> None:
    from kvdiet.engine.progress import rate_text

    assert f"{rate_text(rate)} requests/s" == text


def test_engine_progress_lines_show_a_slow_rate(capsys) -> None:
    import io

    from rich.console import Console

    from kvdiet.sim.command import _progress

    stream, now = io.StringIO(), [0.0]
    bar = _progress(Console(file=stream), 3, "engine bounded-replay", "requests", 0)
    bar.clock = lambda: now[0]
    with bar:
        for _ in range(3):
            now[0] += 23.0  # a request every 23 s, as on a CPU
            bar.advance(1)
    assert stream.getvalue().splitlines() == [
        "engine bounded-replay 1/3 requests (33.3%), 23.0 s, 0.043 requests/s, about 46 s left",
        "engine bounded-replay 2/3 requests (66.7%), 46.0 s, 0.043 requests/s, about 23 s left",
        "engine bounded-replay 3/3 requests (100.0%), 69.0 s, 0.043 requests/s",
    ]


def test_the_default_checkpoint_runs_fit_their_period_to_the_traces_blocks(tmp_path: Path, capsys) -> None:
    """A generic trace of 100-token blocks was refused with the default runs (checkpoint:4096 is no multiple of
    100), which the user never named; a period the user names is still refused with one that fits."""
    path = tmp_path / "g.jsonl"
    head = {"format": "kvdiet-trace", "version": 1, "block_size": 100}
    rows = [
        {"arrival_s": t, "input_length": 500, "output_length": 5, "hash_ids": [1, 2, 3, 4, 5]} for t in (0, 1)
    ]
    path.write_text("\n".join(json.dumps(x) for x in [head, *rows]) + "\n")
    assert main(["replay", str(path), "--sweep", "none", "--json"]) == 0
    out, err = capsys.readouterr()
    assert [line for line in err.splitlines() if "runs as" in line] == [
        f"kvdiet replay: checkpoint:{k} @ deepseek-v4.1-flash runs as checkpoint:{fit} @ deepseek-v4.1-flash (its "
        "period in whole 100-token blocks)"
        for k, fit in ((4096, 4100), (16384, 16400))
    ]
    names = [r["policy"] for r in json.loads(out)["runs"]]
    assert "checkpoint:4100" in names and "checkpoint:16400" in names
    assert not any("4096" in n or "16384" in n for n in names)
    assert main(["replay", str(path), "--sweep", "none", "--runs", "checkpoint:4096"]) == 2
    assert "(e.g. checkpoint:4100)" in capsys.readouterr().err


def test_a_report_under_a_missing_folder_is_refused_before_the_run(tmp_path: Path, capsys) -> None:
    """``--report`` makes its own folder, not a tree of them: a path under a folder that does not exist (a
    mistyped one) is refused before the trace is read, naming the missing folder, and nothing is created."""
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps({"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}) + "\n"
    )
    argv = ["replay", str(path), "--runs", "bounded-replay", "--sweep", "none", "--report"]
    missing = tmp_path / "typo" / "deeper"
    assert main([*argv, str(missing / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvdiet replay: error: --report {missing / 'out'}: {missing} does not exist")
    assert not (tmp_path / "typo").exists()
    assert main([*argv, str(tmp_path / "new")]) == 0
    assert (tmp_path / "new" / "report.md").is_file()  # one new level is made


def test_the_sweep_plot_names_every_line_and_both_axes(tmp_path: Path, monkeypatch) -> None:
    """The persistent peak (right axis) has its legend entry, the left axis its label, and the two ratios differ
    in marker (the second hollow), so where they meet both show."""
    from types import SimpleNamespace

    import kvdiet.sim.plots as plots

    kept = {}

    def keep(fig, path):
        kept["fig"] = fig
        return str(path)

    monkeypatch.setattr(plots, "_save", keep)
    points = [
        (size, SimpleNamespace(summary=dict(s), config=SimpleNamespace(label="bounded-replay")))
        for size, s in (
            ("1GB", {"hit_ratio": 0.5, "device_hit_ratio": 0.5, "persistent_bytes_peak": 2e9}),
            ("2GB", {"hit_ratio": 0.7, "device_hit_ratio": 0.6, "persistent_bytes_peak": 3e9}),
        )
    ]
    plots.plot_sweep("device-size", points, tmp_path / "sweep.png")
    ax = kept["fig"].axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "hit ratio",
        "device hit ratio",
        "persistent peak bytes (GB, right)",
    ]
    assert ax.get_ylabel() == "share of prompt tokens hit"
    first, second = ax.get_lines()
    assert first.get_marker() != second.get_marker() and second.get_markerfacecolor() == "none"
