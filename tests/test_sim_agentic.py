"""Agentic session files: the shared sample read by hand-checked counts and times, ids made unique per file,
``--session-start`` placements by hand, malformed files named by line or field, the per-session split, the
engine mode on one id per full block, and ``kvdiet replay`` on the sample folder."""

from __future__ import annotations

import json
import math
import random
import re
import sys
from pathlib import Path

import pytest

from kvdiet.cli import main
from kvdiet.sim.agentic import (
    SessionStart,
    parse_session_start,
    read_sessions,
    session_reader,
)
from kvdiet.sim.engine_mode import EngineModeConfig, prompt_ids, run_engine_mode, scale_trace
from kvdiet.sim.model_free import simulate
from kvdiet.sim.records import SimConfig
from kvdiet.sim.traces import TraceError

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "agentic-sample"
needs_sample = pytest.mark.skipif(not SAMPLE.is_dir(), reason="the shared agentic sample is not here")


def _req(t: float, n: int, ids: list[int], out: int = 10, kind: str = "n") -> dict:
    return {"t": t, "type": kind, "model": "m", "in": n, "out": out, "hash_ids": ids}


def _session(path: Path, sid: str, requests: list, *, scope: str = "local", block_size: int = 64) -> Path:
    top = {"id": sid, "models": ["m"], "block_size": block_size, "hash_id_scope": scope, "requests": requests}
    path.write_text(json.dumps(top, indent=1))
    return path


# Two sessions on 64-token blocks, one id per full block. A: main at 0 and 10 s, a sub-agent started at 4 s
# whose requests are at +0 and +3 s (7 s), nested one level further at +1 s (5 s, then +0.5 s: 5.5 s).
A = [
    _req(0.0, 150, [0, 1], kind="s"),
    {
        "t": 4.0,
        "type": "subagent",
        "agent_id": "sub-1",
        "subagent_type": "general",
        "requests": [
            _req(0.0, 140, [0, 1]),
            {"t": 1.0, "type": "subagent", "agent_id": "sub-2", "requests": [_req(0.5, 64, [0])]},
            _req(3.0, 200, [0, 1, 7]),
        ],
    },
    _req(10.0, 300, [0, 1, 2, 3]),
]
B = [_req(0.0, 130, [0, 1], kind="s"), _req(2.0, 190, [0, 1, 5])]


def _folder(tmp_path: Path) -> Path:
    _session(tmp_path / "a.json", "A", A)
    _session(tmp_path / "b.json", "B", B)
    return tmp_path


@needs_sample
def test_the_sample_sessions_by_hand() -> None:
    trace = read_sessions(SAMPLE)
    assert trace.block_size == 64 and not trace.errors
    # session 1: 12 main requests + a 3-request sub-agent; 2: 25 main; 3: 6 main + a 3-request sub-agent
    count = {}
    for r in trace.requests:
        count[r.session, r.kind] = count.get((r.session, r.kind), 0) + 1
    assert count == {
        ("sample-1", "agent"): 12,
        ("sample-1", "subagent"): 3,
        ("sample-2", "agent"): 25,
        ("sample-3", "agent"): 6,
        ("sample-3", "subagent"): 3,
    }
    assert [r.arrival_s for r in trace.requests] == sorted(r.arrival_s for r in trace.requests)
    assert all(len(r.hash_ids) == r.input_tokens // 64 for r in trace.requests)
    # sub-agent agent-1-1 starts at 226.021 s; its requests at +0, +12.085, +26.361 s
    sub = [r for r in trace.requests if r.agent == "agent-1-1"]
    assert [r.arrival_s for r in sub] == pytest.approx([226.021, 238.106, 252.382])
    assert {r.agent for r in trace.requests if r.kind == "agent"} == {"main"}
    # one id space per file: the sub-agent's first 230 blocks are its main agent's (local ids 0..229 in both)
    main1 = next(r for r in trace.requests if r.session == "sample-1" and r.line == 1)
    assert sub[0].hash_ids[:230] == main1.hash_ids[:230] and sub[0].hash_ids[230] != main1.hash_ids[230]
    # other files reuse the local numbers for other content: fresh ids, disjoint across files
    ids = {
        s: {h for r in trace.requests if r.session == s for h in r.hash_ids} for s in ("sample-1", "sample-2")
    }
    assert ids["sample-1"].isdisjoint(ids["sample-2"]) and min(ids["sample-1"]) == 0
    assert read_sessions(SAMPLE).requests == trace.requests  # deterministic
    one = read_sessions(SAMPLE / "session_0003.json")
    assert len(one) == 9 and {r.session for r in one.requests} == {"sample-3"}


def test_sub_agent_times_nest_and_ids_are_shared_within_a_file(tmp_path: Path) -> None:
    trace = read_sessions(_folder(tmp_path))
    got = [(r.arrival_s, r.session, r.agent, r.kind, r.hash_ids) for r in trace.requests]
    assert got == [
        (0.0, "A", "main", "agent", (0, 1)),  # ids renumbered as chains in arrival order
        (0.0, "B", "main", "agent", (2, 3)),  # B's local 0, 1 are new content: fresh ids 2, 3
        (2.0, "B", "main", "agent", (2, 3, 4)),
        (4.0, "A", "sub-1", "subagent", (0, 1)),
        (5.5, "A", "sub-2", "subagent", (0,)),
        (7.0, "A", "sub-1", "subagent", (0, 1, 5)),
        (10.0, "A", "main", "agent", (0, 1, 6, 7)),
    ]
    # line: the request's place in its file, depth-first
    assert [r.line for r in trace.requests if r.session == "A"] == [1, 2, 3, 4, 5]


def test_global_scope_shares_ids_across_files(tmp_path: Path) -> None:
    _session(tmp_path / "a.json", "A", [_req(0, 128, [10, 11])], scope="global")
    _session(tmp_path / "b.json", "B", [_req(1, 128, [10, 12])], scope="global")
    assert [r.hash_ids for r in read_sessions(tmp_path).requests] == [(0, 1), (0, 2)]


def test_session_start_modes_by_hand(tmp_path: Path) -> None:
    assert SessionStart().offsets(3) == [0.0, 0.0, 0.0]
    assert parse_session_start("staggered:60").offsets(3) == [0.0, 60.0, 120.0]
    rng = random.Random(0)
    g1 = -math.log(1.0 - rng.random()) / 2.0
    g2 = -math.log(1.0 - rng.random()) / 2.0
    assert parse_session_start("poisson:2").offsets(3) == pytest.approx([0.0, g1, g1 + g2])
    folder = _folder(tmp_path)
    late = read_sessions(folder, start=parse_session_start("staggered:3"))
    assert [(r.session, r.arrival_s) for r in late.requests][:4] == [
        ("A", 0.0),
        ("B", 3.0),
        ("A", 4.0),
        ("B", 5.0),
    ]
    assert str(parse_session_start("poisson:0.5")) == "poisson:0.5"
    assert str(parse_session_start("poisson:1e-9")) == "poisson:1e-09"  # the least rate taken
    for bad in (
        "",
        "later",
        "together:5",
        "staggered",
        "staggered:-1",
        "staggered:nan",
        "poisson:0",
        "poisson:inf",
        "poisson:1e-300",  # a span of 3e300 s: a session's requests rounded to one time
        "poisson:9.9e-10",
        "poisson:1.1e9",
    ):
        with pytest.raises(ValueError, match="--session-start"):
            parse_session_start(bad)


def test_partial_block_ids_and_integral_floats_are_accepted(tmp_path: Path) -> None:
    _session(tmp_path / "a.json", "A", [_req(0, 150, [0, 1, 2]), {**_req(1, 128, [0, 1]), "in": 128.0}])
    trace = read_sessions(tmp_path / "a.json")
    assert [(r.input_tokens, len(r.hash_ids)) for r in trace.requests] == [(150, 3), (128, 2)]


BAD_REQUESTS = [
    ({**_req(0, 128, [0, 1]), "t": float("inf")}, "requests[0].t must be a finite number >= 0, got Infinity"),
    ({**_req(0, 128, [0, 1]), "t": -1}, "requests[0].t must be a finite number >= 0, got -1"),
    ({**_req(0, 128, [0, 1]), "t": 10**400}, "requests[0].t must be a finite number >= 0, got 1000"),
    ({**_req(0, 128, [0, 1]), "t": "0"}, 'requests[0].t must be a finite number >= 0, got "0"'),
    ({**_req(0, 128, [0, 1]), "in": -5}, "requests[0].in must be an integer >= 0, got -5"),
    (
        {**_req(0, 128, [0, 1]), "out": 10**12},
        "requests[0].out of 1,000,000,000,000 tokens is past 1,073,741,824",
    ),
    ({**_req(0, 128, [0, 1]), "in": 99.5}, "requests[0].in must be a whole number of tokens, got 99.5"),
    (
        {k: v for k, v in _req(0, 128, [0, 1]).items() if k != "out"},
        "requests[0].out must be an integer >= 0, got null",
    ),
    (
        _req(0, 150, [0]),
        "requests[0].hash_ids: 1 ids for in=150: expected 150 // 64 = 2 (one per full block) or 3",
    ),
    (
        _req(0, 128, [0, 1, 2]),
        "requests[0].hash_ids: 3 ids for in=128: expected 128 // 64 = 2 (one per full block)",
    ),
    (_req(0, 128, [0, "x"]), "requests[0].hash_ids: expected a list of integers"),
    ({**_req(0, 128, [0, 1]), "type": "tool"}, 'requests[0].type: expected "s", "n" or "subagent"'),
    ({"t": 1, "type": "subagent", "agent_id": "x"}, "requests[0].requests: expected a list"),
    ({"t": 1, "type": "subagent", "requests": []}, "requests[0].agent_id:"),
    (
        {"t": 1, "type": "subagent", "agent_id": "x", "requests": [{**_req(0, 64, [0]), "t": None}]},
        "requests[0].requests[0].t must be a finite number >= 0, got null",
    ),
    ([1, 2], "requests[0]: expected an object, got list"),
]


@pytest.mark.parametrize(("bad", "message"), BAD_REQUESTS)
def test_a_malformed_request_is_named_by_its_field(tmp_path: Path, bad, message: str) -> None:
    path = _session(tmp_path / "s.json", "S", [bad, _req(5, 64, [0])])
    with pytest.raises(TraceError, match=re.escape(f"{path}: {message}")):
        read_sessions(path, strict=True)
    trace = read_sessions(path)  # not strict: skipped, counted, the rest read
    assert len(trace.errors) == 1 and "\n" not in trace.errors[0] and len(trace) == 1


def test_json_infinity_in_a_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(
        '{"id": "S", "block_size": 64, "hash_id_scope": "local", "requests": '
        '[{"t": Infinity, "type": "n", "in": 64, "out": 1, "hash_ids": [0]}]}'
    )
    with pytest.raises(
        TraceError, match=r"requests\[0\]\.t must be .* got Infinity$"
    ):  # as the file spells it
        read_sessions(path, strict=True)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"id": "S",\n "block_size": 64,\n "requests": [}', r"s\.json:3:15: not JSON"),
        ("[]", "a session file is one JSON object, got list"),
        ("[" * 100_000 + "]" * 100_000, r"s\.json: JSON nested too deep"),  # was a RecursionError traceback
        ('{"block_size": 64, "hash_id_scope": "local", "requests": []}', "id must be a non-empty string"),
        (
            '{"id": "S", "block_size": 0, "hash_id_scope": "local", "requests": []}',
            "block_size must be an integer in",
        ),
        (
            '{"id": "S", "block_size": 1' + "0" * 400 + ', "hash_id_scope": "local", "requests": []}',
            r"block_size must be an integer in \[1, 1,073,741,824\], got 1000",
        ),
        (
            '{"id": "S", "block_size": 64, "hash_id_scope": "local", "requests": [{"t": 1'
            + "0" * 5000
            + "}]}",
            rf"s\.json: not valid JSON \(an integer of more than {sys.get_int_max_str_digits():,} digits\)$",
        ),
        ('{"id": "S", "block_size": 64, "hash_id_scope": "file", "requests": []}', "hash_id_scope must be"),
        ('{"id": "S", "block_size": 64, "hash_id_scope": "local"}', "requests must be a list"),
    ],
)
def test_a_malformed_file_is_named_by_line_or_field(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "s.json").write_text(text)
    _session(tmp_path / "t.json", "T", [_req(0, 64, [0])])
    with pytest.raises(TraceError, match=message):
        read_sessions(tmp_path, strict=True)
    trace = read_sessions(tmp_path)
    assert len(trace.errors) == 1 and [r.session for r in trace.requests] == ["T"]


def test_files_that_disagree_and_an_empty_folder(tmp_path: Path) -> None:
    _session(tmp_path / "a.json", "A", [_req(0, 64, [0])])
    _session(tmp_path / "b.json", "A", [_req(0, 64, [0])])
    _session(tmp_path / "c.json", "C", [_req(0, 32, [])], block_size=32)
    with pytest.raises(TraceError, match="session id 'A' is also"):
        read_sessions(tmp_path, strict=True)
    trace = read_sessions(tmp_path)
    assert len(trace) == 1 and len(trace.errors) == 2 and "block_size 32 differs" in trace.errors[1]
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match="no session files"):
        read_sessions(tmp_path / "empty")


def test_session_reader_picks_the_format_and_checks_the_flag_first(tmp_path: Path) -> None:
    assert session_reader(tmp_path, format="auto", start=None) is not None
    assert session_reader(tmp_path / "x.json", format="auto", start="staggered:1") is not None
    assert session_reader(tmp_path / "x.jsonl", format="auto", start=None) is None
    with pytest.raises(ValueError, match="applies to agentic session files"):
        session_reader(tmp_path / "x.jsonl", format="mooncake", start="together")
    with pytest.raises(ValueError, match="--session-start 'soon'"):
        session_reader(tmp_path / "missing", format="agentic-sessions", start="soon")


def test_the_study_splits_an_agentic_trace_by_session_and_kind() -> None:
    trace = read_sessions(SAMPLE)
    s = simulate(trace, SimConfig(model="deepseek-v4.1-flash")).summary
    sessions = {k: v["requests"] for k, v in s["by_session"].items()}
    assert sessions == {
        r.session: sum(q.session == r.session for q in trace.requests) for r in trace.requests
    }
    assert {k: v["requests"] for k, v in s["by_kind"].items()} == {"agent": 43, "subagent": 6}
    assert sum(v["prompt_tokens"] for v in s["by_kind"].values()) == s["prompt_tokens"]
    assert (
        sum(v["persistent_bytes_written"] for v in s["by_session"].values()) == s["persistent_bytes_written"]
    )


def test_engine_mode_takes_one_id_per_full_block(tmp_path: Path) -> None:
    trace = read_sessions(_folder(tmp_path))
    small = scale_trace(trace, 16)
    assert [r.session for r in small.requests] == [r.session for r in trace.requests]
    # 190 = 2 × 64 + 62 → 2 × 16 + ceil(62 × 16 / 64) = 48: three full engine blocks, two ids
    b2 = small.requests[2]
    assert (b2.input_tokens, len(b2.hash_ids)) == (48, 3)
    a0 = small.requests[0]  # 150 → 38 tokens, ids (0, 1): block 2 is the request's own
    assert (a0.input_tokens, a0.hash_ids) == (38, (0, 1))
    p0, p3 = prompt_ids(a0, 0, 16, 129_280), prompt_ids(small.requests[3], 3, 16, 129_280)
    assert len(p0) == 38 and p0[:32] == p3[:32] and p0[32:] != p3[32:38]
    res = run_engine_mode(trace, EngineModeConfig(model="v4.1-micro", max_requests=len(trace)))
    assert res.requests == res.model_free and res.agreeing == len(trace)
    assert sum(r.hit_tokens > 0 for r in res.requests) >= 3


def test_kvdiet_replay_on_session_files(tmp_path: Path, capsys) -> None:
    (tmp_path / "s").mkdir()
    folder = _folder(tmp_path / "s")
    argv = ["replay", str(folder), "--runs", "bounded-replay,exact-recompute", "--sweep", "none", "--json"]
    assert main([*argv, "--format", "agentic-sessions", "--jobs", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trace"]["requests"] == 7 and out["trace"]["block_size"] == 64
    split = next(r["summary"] for r in out["runs"] if r["label"] == "bounded-replay @ deepseek-v4.1-flash")
    assert split["by_session"]["A"]["requests"] == 5 and split["by_kind"]["subagent"]["requests"] == 3
    assert main([*argv, "--session-start", "poisson:0.1", "--jobs", "1"]) == 0  # auto: a folder is sessions
    assert json.loads(capsys.readouterr().out)["trace"]["requests"] == 7


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--session-start", "staggered:-5"], "error: --session-start 'staggered:-5': expected together"),
        (["--strict"], r"error: .*bad\.json: requests\[0\]\.t must be a finite number"),
    ],
)
def test_kvdiet_replay_errors_are_one_line(tmp_path: Path, capsys, extra: list[str], message: str) -> None:
    _session(tmp_path / "bad.json", "S", [{**_req(0, 64, [0]), "t": -3}, _req(1, 64, [0])])
    report = tmp_path / "out"
    argv = ["replay", str(tmp_path), "--runs", "bounded-replay", "--sweep", "none", "--json"]
    assert main([*argv, *extra, "--report", str(report)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err)
    if extra[0] == "--session-start":
        assert not report.exists()  # checked before any work


def test_kvdiet_replay_refuses_session_start_for_other_formats(tmp_path: Path, capsys) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps({"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}) + "\n"
    )
    assert main(["replay", str(path), "--session-start", "together", "--mode", "stats"]) == 2
    assert "applies to agentic session files" in capsys.readouterr().err


@needs_sample
def test_kvdiet_replay_on_the_sample(tmp_path: Path, capsys) -> None:
    argv = [
        "replay",
        str(SAMPLE),
        "--format",
        "agentic-sessions",
        "--runs",
        "bounded-replay",
        "--sweep",
        "none",
    ]
    assert main([*argv, "--json", "--jobs", "1", "--report", str(tmp_path / "out")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trace"]["requests"] == 49 and out["trace"]["skipped_lines"] == 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert (
        "## Per session (bounded-replay @ deepseek-v4.1-flash)" in md
        and "## Policy comparison by traffic kind" in md
    )
    for session in ("sample-1", "sample-2", "sample-3"):
        assert f"| {session} |" in md
    (run,) = out["runs"]
    assert run["summary"]["hit_ratio"] > 0.8  # each session resends its growing context
    split = run["summary"]
    assert set(split["by_session"]) == {"sample-1", "sample-2", "sample-3"}
    assert split["by_kind"]["agent"]["requests"] + split["by_kind"]["subagent"]["requests"] == 49


def test_a_session_file_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    path = _session(tmp_path / "s.json", "A", B)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())  # was "not JSON: Unexpected UTF-8 BOM"
    trace = read_sessions(path, strict=True)
    assert [(r.arrival_s, r.input_tokens) for r in trace.requests] == [(0.0, 130), (2.0, 190)]


def test_gzip_session_files_are_read_as_plain_ones_and_a_corrupt_one_is_named(tmp_path: Path) -> None:
    import gzip

    plain = tmp_path / "plain"
    plain.mkdir()
    _session(plain / "a.json", "A", B)
    _session(plain / "b.json", "B", B)
    packed = tmp_path / "packed"
    packed.mkdir()
    for name in ("a", "b"):
        (packed / f"{name}.json.gz").write_bytes(gzip.compress((plain / f"{name}.json").read_bytes()))

    def seen(path: Path) -> list[tuple]:
        return [(r.arrival_s, r.input_tokens, r.hash_ids) for r in read_sessions(path, strict=True).requests]

    assert seen(packed) == seen(plain) and len(seen(plain)) == 4  # a folder of them: was "no session files"
    assert seen(packed / "a.json.gz") == seen(plain / "a.json")
    assert session_reader(packed / "a.json.gz", format="auto", start=None) is not None
    (packed / "c.json.gz").write_bytes(gzip.compress(b'{"id": "C"')[:-6])  # cut short
    with pytest.raises(TraceError, match=r"c\.json\.gz: a gzip file cut short"):
        read_sessions(packed, strict=True)


@needs_sample
def test_the_readmes_agentic_sample_table_is_what_the_study_gives() -> None:
    from kvdiet.sim.study import DEFAULT_RUNS, parse_run

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    head = readme.index(
        "kvdiet replay ../shared/traces/agentic-sample --format agentic-sessions --report out/"
    )
    lines = readme[head:].split("\n\n")[1].splitlines()  # the table after the command's paragraph
    cols = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c.strip().strip("*") for c in line.strip("|").split("|")] for line in lines[2:]]
    trace = read_sessions(SAMPLE)
    base = SimConfig(model="deepseek-v4.1-flash")
    units = {"kB": 1e3, "MB": 1e6, "GB": 1e9}
    assert len(rows) == len(DEFAULT_RUNS)
    for row, run in zip(rows, DEFAULT_RUNS, strict=True):
        s = simulate(trace, parse_run(run, base)).summary
        cell = dict(zip(cols, row, strict=True))
        value, unit = cell["persistent peak"].split()
        # the V4-Flash boundary-snapshot peak read 943.6 MB, from snapshots counted as window entries only
        assert s["persistent_bytes_peak"] / units[unit] == pytest.approx(
            float(value), abs=0.051 * (unit != "GB") + 0.0051
        )
        share = cell["window at peak"]
        assert s["persistent_window_share_at_peak"] == pytest.approx(
            float(share.rstrip("%") or 0) / 100, abs=5.1e-4
        )
        assert s["replayed_tokens"] == int(cell["replayed tokens"].replace(",", ""))


def test_times_going_backwards_in_a_list_are_counted_and_refused_under_strict(tmp_path: Path) -> None:
    sub = {
        "t": 5.0,
        "type": "subagent",
        "agent_id": "s",
        "requests": [_req(2.0, 64, [0]), _req(1.0, 64, [0])],
    }
    path = _session(
        tmp_path / "a.json", "A", [_req(0.0, 64, [0]), _req(9.0, 128, [0, 1]), sub, _req(8.0, 64, [0])]
    )
    trace = read_sessions(path)  # the sub-agent's start (5 s) and its second request (6 s) go back, and 8 s
    assert trace.out_of_order == 3 and not trace.errors  # was 0: re-sorted without a word
    assert [r.arrival_s for r in trace.requests] == [0.0, 6.0, 7.0, 8.0, 9.0]
    with pytest.raises(TraceError, match=r"a\.json: requests\[2\]\.t: 5 s is before requests\[1\]'s 9 s"):
        read_sessions(path, strict=True)


def test_a_skipped_entry_is_not_counted_as_going_backwards_nor_moves_the_clock(tmp_path: Path) -> None:
    """Only entries read count: a malformed one (skipped) at 9 s makes the 5 s request after it no later than
    the 0 s one, and a malformed one at 2 s after it is no request that goes backwards ("1 of 0" requests)."""
    bad_late, bad_early = _req(9.0, 64, [0]) | {"in": None}, _req(2.0, 64, [0]) | {"in": None}
    trace = read_sessions(
        _session(tmp_path / "a.json", "A", [_req(0.0, 64, [0]), bad_late, _req(5.0, 64, [0]), bad_early])
    )
    assert len(trace.errors) == 2 and trace.out_of_order == 0
    assert [r.arrival_s for r in trace.requests] == [0.0, 5.0]


def test_the_block_hit_ratio_counts_a_sessions_unnamed_partial_blocks_as_a_jsonl_trace_does(
    tmp_path: Path,
) -> None:
    from kvdiet.sim.trace_stats import hit_ratio_variants, infinite_cache_hit_ratio, trace_stats

    trace = read_sessions(
        _session(tmp_path / "a.json", "A", [_req(0.0, 150, [0, 1]), _req(1.0, 200, [0, 1, 2])])
    )
    # by hand: 3 blocks (2 full, 1 partial without an id), then 4 (3 full, 1 partial); hits 0, then 0 and 1
    assert infinite_cache_hit_ratio(trace) == pytest.approx(2 / 7)  # was 2 / 5: the partial blocks left out
    assert trace_stats(trace)["infinite_cache_block_hit_ratio"] == hit_ratio_variants(trace)["blocks"]


def test_a_wrong_value_is_named_in_a_short_line(tmp_path: Path) -> None:
    wrong = {
        "t": 1.0,
        "type": "subagent",
        "agent_id": "s",
        "requests": {str(i): _req(0.0, 64, [0]) for i in range(500)},
    }
    path = _session(tmp_path / "a.json", "A", [_req(0.0, 64, [0]), wrong])
    trace = read_sessions(path)
    # was the whole dict of 500 requests (~50 kB) in the one line
    assert trace.errors == [
        f"{path}: requests[1].requests: expected a list, got " + json.dumps(wrong["requests"])[:60] + "..."
    ]
