"""Trace readers on small hand-made files with known answers, line-numbered errors, and (when the shared
copies are present) the real Mooncake and Azure traces."""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

import pytest

from kvdiet.sim.model_free import simulate
from kvdiet.sim.records import SimConfig
from kvdiet.sim.trace_fields import MAX_REQUEST_TOKENS
from kvdiet.sim.trace_stats import hit_ratio_variants, infinite_cache_hit_ratio
from kvdiet.sim.traces import TraceError, read_trace

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


MOONCAKE = [
    {"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
    {"timestamp": 1000, "input_length": 1500, "output_length": 7, "hash_ids": [1, 2, 3]},
    {"timestamp": 500, "input_length": 600, "output_length": 1, "hash_ids": [1, 4]},
]


def test_mooncake_lines_are_read_in_arrival_order_with_the_hit_ratio_by_hand(tmp_path: Path) -> None:
    trace = read_trace(_write_jsonl(tmp_path / "t.jsonl", MOONCAKE))
    assert trace.block_size == 512 and not trace.errors
    assert [(r.arrival_s, r.input_tokens, r.output_tokens, r.hash_ids, r.line) for r in trace.requests] == [
        (0.0, 1024, 5, (0, 1), 1),  # the ids renumbered as chains (kvdiet.sim.chains): 1 → 0, 1·2 → 1, ...
        (0.5, 600, 1, (0, 2), 3),
        (1.0, 1500, 7, (0, 1, 3), 2),
    ]
    # 0 of 2, then 1 of 2 (block 1; 4 is new), then 2 of 3 (blocks 1, 2; 3 is new): 3 of 7 blocks.
    assert infinite_cache_hit_ratio(trace) == pytest.approx(3 / 7)


def test_a_break_in_the_prefix_ends_the_match() -> None:
    from kvdiet.sim.traces import Trace, TraceRequest

    trace = Trace([TraceRequest(0, 1536, 1, (1, 2, 3), 1), TraceRequest(1, 1536, 1, (1, 9, 3), 2)], 512)
    assert infinite_cache_hit_ratio(trace) == pytest.approx(1 / 6)  # 3 is seen but follows a miss


def test_malformed_lines_are_reported_with_their_numbers(tmp_path: Path) -> None:
    rows = [
        MOONCAKE[0],
        "{not json",
        {"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [1]},
        {"timestamp": 2, "input_length": 10, "output_length": -1, "hash_ids": [1]},
        {"timestamp": 3, "input_length": 10, "output_length": 1, "hash_ids": [True]},
        *[MOONCAKE[1]] * 5,
    ]
    path = _write_jsonl(tmp_path / "bad.jsonl", rows)
    trace = read_trace(path)
    assert [r.line for r in trace.requests] == [1, 6, 7, 8, 9, 10]
    assert [e.split(": ", 1)[0] for e in trace.errors] == [f"{path}:{n}" for n in (2, 3, 4, 5)]
    assert "1 hash_ids for input_length 1024: expected ceil(1024 / 512) = 2" in trace.errors[1]
    assert "output_length must be an integer >= 0, got -1" in trace.errors[2]
    with pytest.raises(TraceError, match=rf"{path}:2: "):
        read_trace(path, strict=True)


def test_a_time_past_a_floats_range_is_a_malformed_line(tmp_path: Path) -> None:
    """A timestamp written as an integer of 400 digits is not a finite number: the line is named (``float()`` of it
    raised OverflowError, a traceback), and the rest is read."""
    path = tmp_path / "big.jsonl"
    big = '{"timestamp": 1' + "0" * 400 + ', "input_length": 10, "output_length": 1, "hash_ids": [1]}'
    path.write_text(big + "\n" + json.dumps(MOONCAKE[1]) + "\n")
    trace = read_trace(path)
    assert [r.line for r in trace.requests] == [2]
    assert trace.errors[0].startswith(f"{path}:1: timestamp must be a finite number >= 0, got 1000")


def test_an_integer_past_pythons_digit_limit_is_a_malformed_line(tmp_path: Path) -> None:
    """``json.loads`` raises a bare ValueError (naming ``sys.set_int_max_str_digits``) for an integer literal of more
    than 4,300 digits: the line is malformed, named as such, and the rest is read."""
    path = tmp_path / "long.jsonl"
    long = '{"timestamp": 1' + "0" * 5000 + ', "input_length": 10, "output_length": 1, "hash_ids": [1]}'
    path.write_text(long + "\n" + json.dumps(MOONCAKE[1]) + "\n")
    trace = read_trace(path)
    assert [r.line for r in trace.requests] == [2]
    digits = f"{sys.get_int_max_str_digits():,}"
    assert trace.errors == [f"{path}:1: not valid JSON (an integer of more than {digits} digits)"]


def test_a_folder_given_for_a_trace_file_is_named(tmp_path: Path) -> None:
    """``--format mooncake`` on a folder of session files printed ``[Errno 21] Is a directory``."""
    for fmt, kind in (("mooncake", "mooncake trace"), ("azure", "azure trace"), ("auto", "trace")):
        with pytest.raises(TraceError, match=f"^{tmp_path}: a folder, not a {kind} file .*agentic-sessions"):
            read_trace(tmp_path, format=fmt)


def test_generic_jsonl_uses_its_block_size(tmp_path: Path) -> None:
    rows = [
        {"format": "kvdiet-trace", "version": 1, "block_size": 16},
        {"arrival_s": 0.25, "input_length": 33, "output_length": 2, "hash_ids": [7, 8, 9]},
        {"arrival_s": 1.5, "input_length": 32, "output_length": 2, "hash_ids": [7, 8]},
    ]
    trace = read_trace(_write_jsonl(tmp_path / "g.jsonl", rows))
    # times count from the trace's first request (TraceRequest.arrival_s)
    assert trace.block_size == 16 and [r.arrival_s for r in trace.requests] == [0.0, 1.25]
    assert infinite_cache_hit_ratio(trace) == pytest.approx(2 / 5)
    with pytest.raises(TraceError, match="starts with"):
        read_trace(_write_jsonl(tmp_path / "nohead.jsonl", rows[1:]), format="jsonl")
    with pytest.raises(TraceError, match="unknown trace format"):
        read_trace(tmp_path / "g.jsonl", format="parquet")


def test_generic_lines_carry_session_agent_and_kind_and_the_study_splits_by_kind(tmp_path: Path) -> None:
    head = {"format": "kvdiet-trace", "version": 1, "block_size": 64}
    chat = {"session": "c1", "kind": "chat"}
    agent = {"session": "a1", "agent": "main", "kind": "agent"}
    rows = [
        head,
        {"arrival_s": 0.0, "input_length": 1024, "output_length": 1, "hash_ids": list(range(16)), **agent},
        {"arrival_s": 1.0, "input_length": 100, "output_length": 1, "hash_ids": [100, 101], **chat},
        {"arrival_s": 2.0, "input_length": 1088, "output_length": 1, "hash_ids": list(range(17)), **agent},
        {"arrival_s": 3.0, "input_length": 64, "output_length": 1, "hash_ids": [200]},
    ]
    trace = read_trace(_write_jsonl(tmp_path / "mixed.jsonl", rows))
    assert [(r.session, r.agent, r.kind) for r in trace.requests] == [
        ("a1", "main", "agent"),
        ("c1", None, "chat"),
        ("a1", "main", "agent"),
        (None, None, None),
    ]
    s = simulate(trace, SimConfig(model="deepseek-v4.1-flash")).summary
    by_kind = s["by_kind"]
    # the line without a kind is its own group: the split adds up to the run
    assert {k: v["requests"] for k, v in by_kind.items()} == {"agent": 2, "chat": 1, "(untagged)": 1}
    assert sum(v["prompt_tokens"] for v in by_kind.values()) == s["prompt_tokens"]
    # the agent's second prompt finds the first's 16 blocks (1,024 tokens) and the window state stored
    # at its end in the SWA pool: one restore, nothing recomputed before 1,024
    agent_figures = by_kind["agent"]
    assert (agent_figures["prompt_tokens"], agent_figures["hit_tokens"]) == (1024 + 1088, 1024)
    assert agent_figures["restores"] == 1
    assert (by_kind["chat"]["prompt_tokens"], by_kind["chat"]["hit_tokens"]) == (100, 0)
    line = {"arrival_s": 0.0, "input_length": 64, "output_length": 1, "hash_ids": [1]}
    for kind in (3, "", "  ", "a\nb"):
        with pytest.raises(TraceError, match="kind must be a non-blank string of printable characters"):
            read_trace(_write_jsonl(tmp_path / "bad.jsonl", [head, line | {"kind": kind}]), strict=True)
    for header, message in (
        (head | {"version": 2}, "generic trace version 2; this reader reads version 1"),
        (
            head | {"block_size": "16"},
            'block_size must be an integer in \\[1, 1,073,741,824\\] \\(tokens per hash id\\), got "16"',
        ),
        ({"format": "kvdiet-trace", "version": 1}, "block_size must be an integer in"),
        (head | {"block_size": 10**400}, r"block_size must be an integer in .*, got 1000"),  # was run
    ):
        with pytest.raises(TraceError, match=message):
            read_trace(_write_jsonl(tmp_path / "head.jsonl", [header, line]), format="jsonl")


def test_azure_csv_has_unique_prompts_and_relative_times(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:15:51,x,3\n"
        "2023-11-16 18:16:46.6805900,1024,1\n"
    )
    trace = read_trace(path)
    assert [(round(r.arrival_s, 6), r.input_tokens, r.hash_ids) for r in trace.requests] == [
        (0.0, 374, None),
        (4.314579, 396, None),
        (60.0, 1024, None),
    ]
    assert len(trace.errors) == 1 and trace.errors[0].startswith(f"{path}:4: ")
    assert infinite_cache_hit_ratio(trace) == 0.0


@pytest.mark.skipif(not SHARED.is_dir(), reason="the shared trace copies are not on this machine")
def test_the_real_traces() -> None:
    conv = read_trace(SHARED / "mooncake" / "conversation_trace.jsonl", strict=True)
    synth = read_trace(SHARED / "mooncake" / "synthetic_trace.jsonl", strict=True)
    assert (len(conv), len(synth)) == (12_031, 3_993)
    # The shared README's recount with an infinite cache and contiguous-prefix matching: 36.6% and 64.0%.
    assert infinite_cache_hit_ratio(conv) == pytest.approx(0.366, abs=5e-4)
    assert infinite_cache_hit_ratio(synth) == pytest.approx(0.640, abs=5e-4)
    # the Mooncake paper's 40% / 66%: the per-request mean (conversation) and full-block count (synthetic)
    assert hit_ratio_variants(conv)["mean_per_request"] == pytest.approx(0.409, abs=5e-4)
    assert hit_ratio_variants(synth)["full_blocks"] == pytest.approx(0.659, abs=5e-4)
    azure = read_trace(SHARED / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv", strict=True)
    assert len(azure) == 19_366 and azure.requests[0].arrival_s == 0.0


def test_empty_prompts_are_counted_warned_and_left_out_of_the_per_request_mean(
    tmp_path: Path, capsys
) -> None:
    """A request with ``input_length`` 0 has no hit ratio: the per-request mean is over the other requests (was:
    counted as 0, here 0.333 for 0.5), the stats count it, and replay says so on stderr."""
    from kvdiet.cli import main

    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 100, "input_length": 0, "output_length": 5, "hash_ids": []},
        {"timestamp": 200, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
    ]
    path = _write_jsonl(tmp_path / "t.jsonl", rows)
    assert hit_ratio_variants(read_trace(path))["mean_per_request"] == 0.5  # (0 + 1) / 2
    assert main(["replay", str(path), "--mode", "stats", "--json"]) == 0
    out, err = capsys.readouterr()
    stats = json.loads(out)["trace"]
    assert stats["requests"] == 3 and stats["empty_prompts"] == 1
    assert "warning: 1 of 3 requests have an empty prompt (input_length 0)" in err
    path = _write_jsonl(tmp_path / "full.jsonl", rows[:1])
    assert main(["replay", str(path), "--mode", "stats", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["trace"]["empty_prompts"] == 0 and "empty prompt" not in err


def test_kvdiet_replay_reports_the_trace(tmp_path: Path, capsys) -> None:
    from kvdiet.cli import main

    path = _write_jsonl(tmp_path / "t.jsonl", [*MOONCAKE, "{broken"])
    assert main(["replay", str(path), "--mode", "stats", "--json"]) == 0
    out, err = capsys.readouterr()
    stats = json.loads(out)["trace"]
    assert stats["requests"] == 3 and stats["blocks"] == 7 and stats["skipped_lines"] == 1
    assert stats["infinite_cache_block_hit_ratio"] == round(3 / 7, 4) and stats["duration_s"] == 1.0
    assert stats["input_tokens"] == {"total": 3124, "mean": 1041.3, "p50": 1024, "p99": 1500}
    # by hand: hits 0, 1, 2 blocks = 0, 512, 1024 tokens of 1024, 600, 1500; full blocks 2, 1, 2
    assert stats["infinite_cache_hit_ratio_variants"] == {
        "blocks": round(3 / 7, 4),
        "tokens": round(1536 / 3124, 4),
        "full_blocks": 0.6,
        "mean_per_request": round((512 / 600 + 1024 / 1500) / 3, 4),
    }
    assert f"skipped {path}:4: " in err
    assert (
        "warning: timestamps go backwards: 1 of 3 requests arrive" in err
        and stats["out_of_order_requests"] == 1
    )
    assert main(["replay", str(path), "--strict"]) == 2  # line 3 (0.5 s) follows line 2 (1 s)
    assert f"kvdiet replay: error: {path}:3: arrives at 0.5 s, before line 2 (1 s)" in capsys.readouterr().err


def _generic(tmp_path: Path, rows: list, name: str = "g.jsonl") -> Path:
    return _write_jsonl(tmp_path / name, [{"format": "kvdiet-trace", "version": 1, "block_size": 16}, *rows])


def test_one_id_per_full_block_is_read_and_the_partial_block_never_hits(tmp_path: Path) -> None:
    rows = [
        {"arrival_s": 0, "input_length": 40, "output_length": 1, "hash_ids": [7, 8]},  # 40 // 16 = 2 ids
        {"arrival_s": 1, "input_length": 50, "output_length": 1, "hash_ids": [7, 8, 9]},  # 50 // 16 = 3
        {"arrival_s": 2, "input_length": 48, "output_length": 1, "hash_ids": [7, 8, 9]},  # no partial block
    ]
    trace = read_trace(_generic(tmp_path, rows))
    assert trace.full_blocks_only is True and not trace.errors
    # each partial last block gets a fresh id above the trace's largest (9): 10, then 11; then the ids are
    # renumbered as chains in arrival order (7 → 0, 7·8 → 1, 7·8·10 → 2, 7·8·9 → 3, 7·8·9·11 → 4)
    assert [r.hash_ids for r in trace.requests] == [(0, 1, 2), (0, 1, 3, 4), (0, 1, 3)]
    # by hand: blocks 3 + 4 + 3 = 10; hits 0, then 7 and 8 (2), then 7, 8, 9 (3): 5 of 10
    assert infinite_cache_hit_ratio(trace) == pytest.approx(5 / 10)
    # a later line that names its partial block breaks the trace's convention: skipped, naming line 2
    mixed = read_trace(_generic(tmp_path, [*rows, *rows[:2], rows[0] | {"hash_ids": [7, 8, 12]}], "m.jsonl"))
    assert len(mixed) == 5 and len(mixed.errors) == 1
    assert (
        "3 hash_ids for input_length 40: expected 40 // 16 = 2 (one id per full block, as line 2)"
        in (mixed.errors[0])
    )
    assert read_trace(_write_jsonl(tmp_path / "c.jsonl", MOONCAKE)).full_blocks_only is False


def test_a_trace_most_of_whose_lines_are_malformed_is_refused_with_a_summary(tmp_path: Path) -> None:
    rows = [MOONCAKE[0], *[{"timestamp": 1, "input_length": 1500, "output_length": 1, "hash_ids": [1]}] * 2]
    path = _write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert str(err.value).startswith(
        f"{path}: 2 of 3 lines malformed, so the trace is refused; the first 2: "
    )
    assert "line 2: 1 hash_ids for input_length 1500: expected ceil(1500 / 512) = 3, or 1500 // 512 = 2" in (
        str(err.value)
    )
    assert "line 3: " in str(err.value)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ('{"arrival_s": Infinity, "input_length": 16, "output_length": 1, "hash_ids": [1]}', "got Infinity"),
        ('{"arrival_s": NaN, "input_length": 16, "output_length": 1, "hash_ids": [1]}', "got NaN"),
        # values as the file spells them (were Python's: True, '3')
        ('{"arrival_s": true, "input_length": 16, "output_length": 1, "hash_ids": [1]}', "got true"),
        ('{"arrival_s": 1, "input_length": "3", "output_length": 1, "hash_ids": [1]}', 'got "3"'),
        ('{"arrival_s": 1, "input_length": 16.5, "output_length": 1, "hash_ids": [1]}', "whole number"),
        ('{"arrival_s": 1, "input_length": Infinity, "output_length": 1, "hash_ids": [1]}', "whole number"),
        (
            '{"timestamp": 1, "input_length": 16, "output_length": 1, "hash_ids": [1]}',
            "no arrival_s (a generic",
        ),
    ],
)
def test_non_finite_times_and_fractional_lengths_are_refused_by_line(
    tmp_path: Path, row: str, message: str
) -> None:
    ok = {"arrival_s": 0, "input_length": 16, "output_length": 1, "hash_ids": [1]}
    path = _generic(tmp_path, [ok, row, ok])
    trace = read_trace(path)
    assert len(trace) == 2 and len(trace.errors) == 1 and trace.errors[0].startswith(f"{path}:3: ")
    assert message in trace.errors[0]
    with pytest.raises(TraceError, match=rf"{path}:3: "):
        read_trace(path, strict=True)


def test_an_integral_float_length_is_a_length(tmp_path: Path) -> None:
    row = {"timestamp": 0, "input_length": 99266.0, "output_length": 5.0, "hash_ids": list(range(194))}
    (r,) = read_trace(_write_jsonl(tmp_path / "t.jsonl", [row])).requests
    assert (r.input_tokens, r.output_tokens) == (99266, 5) and len(r.hash_ids) == 194  # ceil(99266 / 512)


def test_timestamps_going_backwards_are_counted_and_resorted(tmp_path: Path) -> None:
    times = [0, 3000, 1000, 2000, 4000]  # lines 3 and 4 arrive before line 2's 3 s
    rows = [{"timestamp": t, "input_length": 512, "output_length": 1, "hash_ids": [1]} for t in times]
    path = _write_jsonl(tmp_path / "t.jsonl", rows)
    trace = read_trace(path)
    assert trace.out_of_order == 2 and [r.line for r in trace.requests] == [1, 3, 4, 2, 5]
    with pytest.raises(TraceError, match=rf"{path}:3: arrives at 1 s, before line 2 \(3 s\)"):
        read_trace(path, strict=True)


def test_the_shape_of_the_first_record_names_the_expected_format(tmp_path: Path) -> None:
    generic_line = {"arrival_s": 0, "input_length": 16, "output_length": 1, "hash_ids": [1]}
    with pytest.raises(TraceError, match=r"generic kvdiet trace line .arrival_s. but no header"):
        read_trace(_write_jsonl(tmp_path / "a.jsonl", [generic_line]))
    session = {"id": "s", "block_size": 64, "requests": []}
    with pytest.raises(TraceError, match=r"agentic session file .* --format agentic-sessions"):
        read_trace(_write_jsonl(tmp_path / "s.json", [session]))
    with pytest.raises(TraceError, match=r"not a known trace: .*the first record has prompt, t"):
        read_trace(_write_jsonl(tmp_path / "x.jsonl", [{"t": 0, "prompt": "hi"}]))
    # named explicitly as Mooncake, each line says which fields a Mooncake line has
    with pytest.raises(TraceError, match=r"no timestamp .a Mooncake line has timestamp, input_length"):
        read_trace(tmp_path / "a.jsonl", format="mooncake", strict=True)


def test_ids_that_name_a_blocks_content_only_match_only_after_the_same_prefix(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 2048, "output_length": 1, "hash_ids": [1, 2, 3, 4]},
        {"timestamp": 60000, "input_length": 2048, "output_length": 1, "hash_ids": [1, 3, 4, 5]},  # 2 dropped
        {"timestamp": 120000, "input_length": 2048, "output_length": 1, "hash_ids": [1, 1, 1, 1]},
        {"timestamp": 180000, "input_length": 2048, "output_length": 1, "hash_ids": [1, 1, 1, 1]},
    ]
    trace = read_trace(_write_jsonl(tmp_path / "content.jsonl", rows))
    # by hand: 1 then 3 ≠ 2: 1 block; [1, 1, 1, 1]: only its first 1 was seen at the root: 1 block; the
    # same prompt again: all 4 blocks (the 3 usable before the prompt's last token in the simulator)
    assert infinite_cache_hit_ratio(trace) == pytest.approx((0 + 1 + 1 + 4) / 16)
    s = simulate(trace, SimConfig(model="deepseek-v4.1-flash")).summary
    assert s["device_hit_tokens"] + s["persistent_hit_tokens"] == 512 + 512 + 3 * 512  # was 4,608


def test_negative_ids_never_meet_the_simulators_ids_for_unnamed_blocks(tmp_path: Path) -> None:
    rows = [  # request 1's partial block (tokens 512–999) is one the simulator names itself: -1 before
        {"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [5, 6]},
        {"timestamp": 60000, "input_length": 1536, "output_length": 1, "hash_ids": [5, -1, 9]},
    ]
    trace = read_trace(_write_jsonl(tmp_path / "signed.jsonl", rows))
    assert all(h >= 0 for r in trace.requests for h in r.hash_ids)
    s = simulate(trace, SimConfig(model="deepseek-v4.1-flash")).summary
    assert s["device_hit_tokens"] + s["persistent_hit_tokens"] == 512  # block 5 only (was 0)


def test_byte_order_marks_gzip_blank_rows_and_bad_bytes_as_real_dumps_have_them(tmp_path: Path) -> None:
    import gzip

    plain = _write_jsonl(tmp_path / "t.jsonl", MOONCAKE)
    want = [(r.arrival_s, r.input_tokens, r.hash_ids) for r in read_trace(plain).requests]
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())  # the first line was skipped as "Unexpected BOM"
    packed = tmp_path / "t.log"  # gzip by its magic bytes, whatever the name
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    for path in (bom, packed):
        trace = read_trace(path)
        assert (
            not trace.errors and [(r.arrival_s, r.input_tokens, r.hash_ids) for r in trace.requests] == want
        )
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(plain.read_bytes() * 50)[:-12])
    with pytest.raises(TraceError, match=r"cut\.jsonl\.gz: a gzip file cut short"):
        read_trace(cut)
    # a bad CRC, data that does not inflate: one error naming the file, no traceback
    for name, at in (("crc.jsonl.gz", -6), ("inflate.jsonl.gz", 30)):
        broken = bytearray(gzip.compress(plain.read_bytes() * 50))
        broken[at] ^= 0xFF
        (tmp_path / name).write_bytes(bytes(broken))
        with pytest.raises(TraceError, match=rf"{name.replace('.', '[.]')}: a corrupt gzip file"):
            read_trace(tmp_path / name)
    rows = "TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:15:46.6805900,374,44\r\n\r\n"
    rows += "2023-11-16 18:15:47.6805900,3\xe974,44\r\n2023-11-16 18:15:48.6805900,396,109\r\n,,\r\n"
    azure = tmp_path / "azure.csv.gz"  # a BOM (refused the whole file), a blank row, a latin-1 byte
    azure.write_bytes(gzip.compress(b"\xef\xbb\xbf" + rows.encode("latin-1")))
    trace = read_trace(azure)
    assert [(r.arrival_s, r.input_tokens) for r in trace.requests] == [(0.0, 374), (2.0, 396)]
    # the bad byte's row, and a row of empty fields (not blank: three fields, none a value)
    assert [e.split(": ")[0] for e in trace.errors] == [f"{azure}:4", f"{azure}:6"]


def test_lengths_no_request_has_and_broken_lines_are_named_in_the_lines_own_terms(tmp_path: Path) -> None:
    """A length past MAX_REQUEST_TOKENS is a malformed line (was: a MemoryError from the simulator at 1e11, and a
    301-digit number in the message at 1e300); bytes that are not UTF-8 are named so; a cut line gets JSON's reason
    at its column (was "line 1 column 57" beside the file's line number)."""
    ok = MOONCAKE[0]
    rows = [
        ok,
        {**ok, "output_length": 100_000_000_000},
        '{"timestamp": 1, "input_length": 1e300, "output_length": 1, "hash_ids": [1]}',
        '{"timestamp": 2, "input_length": 1024, "output_len',
        ok,
        ok,
        {**ok, "output_length": MAX_REQUEST_TOKENS},  # the cap itself is read
    ]
    path = _write_jsonl(tmp_path / "t.jsonl", rows)
    with path.open("ab") as f:
        f.write(b'\xff\xfe{"timestamp": 3}\n')
    trace = read_trace(path)
    assert [r.output_tokens for r in trace.requests] == [5, 5, 5, MAX_REQUEST_TOKENS]
    assert trace.errors == [
        f"{path}:2: output_length of 100,000,000,000 tokens is past 1,073,741,824: not a real request",
        f"{path}:3: input_length of some 10^300 tokens is past 1,073,741,824: not a real request",
        f"{path}:4: not valid JSON (Unterminated string starting at column 40)",
        f"{path}:8: bytes that are not UTF-8",
    ]
    csv_path = tmp_path / "azure.csv"
    csv_path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:47.6805900,374,4400000000\n"
    )
    azure = read_trace(csv_path)
    assert len(azure) == 1 and azure.errors == [
        f"{csv_path}:3: GeneratedTokens of 4,400,000,000 tokens is past 1,073,741,824: not a real request"
    ]


def test_json_nested_past_the_recursion_limit_is_a_malformed_line(tmp_path: Path) -> None:
    """Arrays nested 100,000 deep: json raises RecursionError (was a traceback out of `kvdiet replay`); the line
    is malformed like any other, also as the first line, where the format is detected."""
    deep = "[" * 100_000 + "]" * 100_000
    path = _write_jsonl(tmp_path / "deep.jsonl", [MOONCAKE[0], deep, MOONCAKE[1], MOONCAKE[2]])
    trace = read_trace(path)
    assert len(trace) == 3 and trace.errors == [f"{path}:2: JSON nested too deep"]
    first = _write_jsonl(tmp_path / "first.jsonl", [deep, *MOONCAKE, *MOONCAKE])
    assert read_trace(first).errors == [f"{first}:1: JSON nested too deep"]


def test_a_line_past_the_cap_stops_the_read_with_its_number(tmp_path: Path) -> None:
    """A file with no newline in sight (``/dev/zero``, a binary, a document read as lines) is refused at the
    line that passes `MAX_LINE_CHARS`, after reading no more than that (was: memory filled without end; not
    tried on ``/dev/zero`` itself, which a regression would read until the machine ran out of memory)."""
    from kvdiet.sim.trace_file import MAX_LINE_CHARS

    blob = "\0" * (MAX_LINE_CHARS + 1)
    for name, rows in (("zero.jsonl", [blob]), ("zero.csv", [blob]), ("long.jsonl", [MOONCAKE[0], blob])):
        path = _write_jsonl(tmp_path / name, rows)
        with pytest.raises(
            TraceError, match=rf"^{path}:{len(rows)}: a line longer than {MAX_LINE_CHARS:,} characters"
        ):
            read_trace(path)
    unclosed = tmp_path / "unclosed.csv"  # a quote never closed: the rest of the file is one field
    unclosed.write_text('TIMESTAMP,ContextTokens,GeneratedTokens\n"2023-11-16,1,1\n' + "x,1,1\n" * 30_000)
    with pytest.raises(TraceError, match=rf"^{unclosed}: not a CSV trace \(field larger than field limit"):
        read_trace(unclosed)  # was csv.Error, a traceback out of `kvdiet replay`
    at_cap = _write_jsonl(tmp_path / "cap.jsonl", [MOONCAKE[0], "x" * (MAX_LINE_CHARS - 1), *MOONCAKE])
    assert read_trace(at_cap).errors[0].startswith(f"{at_cap}:2: not valid JSON")  # the cap itself is a line


def test_a_trace_on_epoch_time_starts_at_0_as_any_other(tmp_path: Path) -> None:
    epoch = [dict(r, timestamp=r["timestamp"] + 1_733_000_000_000) for r in MOONCAKE]  # ms since 1970
    trace = read_trace(_write_jsonl(tmp_path / "epoch.jsonl", epoch))
    assert [r.arrival_s for r in trace.requests] == [0.0, 0.5, 1.0]  # was 1,733,000,000.0, ...
    config = SimConfig(model="deepseek-v4.1-flash")
    got = simulate(trace, config)
    want = simulate(read_trace(_write_jsonl(tmp_path / "t.jsonl", MOONCAKE)), config)
    assert got.series["t_s"][0] == 0.0 and got.series == want.series and got.summary == want.summary


def test_a_wrong_csv_header_is_named_in_one_short_line(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "t.jsonl", [dict(MOONCAKE[0], hash_ids=list(range(5000)), input_length=5000 * 512)]
    )
    with pytest.raises(TraceError) as exc:
        read_trace(path, format="azure")
    # was the whole first line as a list of its 5,004 comma-separated fields (~40 kB)
    message = str(exc.value)
    assert len(message) < 300 + len(str(path))
    first = '{"timestamp": 0, "input_length": 2560000, "output_length": 5'  # its first 60 characters, quoted
    assert message.endswith(f"got {json.dumps(first)}...")


@pytest.mark.parametrize(
    ("stamps", "complaint"),
    [
        (
            ["2023-11-16 18:17:03", "2023-11-16 18:17:04Z"],
            "'2023-11-16 18:17:04Z' has a time zone where the first row's has none",
        ),
        (
            ["2023-11-16 18:17:03+00:00", "2023-11-16 18:17:04"],
            "'2023-11-16 18:17:04' has no time zone where the first row's has one",
        ),
        (  # after seven fractional digits, as the real traces write them: the zone was cut off with the 7th
            ["2023-11-16 18:17:03.0000000", "2023-11-16 18:17:04.0319600+00:00"],
            "'2023-11-16 18:17:04.0319600+00:00' has a time zone where the first row's has none",
        ),
    ],
)
def test_an_azure_row_mixing_time_zones_is_a_malformed_line(
    tmp_path: Path, stamps: list[str], complaint: str
) -> None:
    """A time zone on some TIMESTAMPs only was a TypeError out of `kvdiet replay` (naive minus aware)."""
    path = tmp_path / "azure.csv"
    rows = [f"{stamps[0]},4808,10", f"{stamps[1]},100,1", "2023-11-16 18:17:05" + stamps[0][19:] + ",50,2"]
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    trace = read_trace(path)
    assert trace.errors == [f"{path}:3: TIMESTAMP {complaint} (give every row one, or none)"]
    assert [(r.arrival_s, r.input_tokens) for r in trace.requests] == [(0.0, 4808), (2.0, 50)]
    with pytest.raises(TraceError, match="has"):
        read_trace(path, strict=True)


def test_an_azure_time_zone_after_the_fraction_is_kept() -> None:
    from kvdiet.sim.traces import _azure_time

    assert _azure_time("2023-11-16 18:17:04.0319600+05:30").utcoffset() == dt.timedelta(hours=5, minutes=30)
    assert _azure_time("2023-11-16 18:17:05.0+00:00").microsecond == 0  # was 'Invalid isoformat ... +00:0'
    assert _azure_time("2023-11-16 18:15:46.6805900") == dt.datetime(2023, 11, 16, 18, 15, 46, 680590)
    with pytest.raises(ValueError, match="Invalid isoformat string"):
        _azure_time("2023-11-16 18:17:05.0+00:0")
