"""`kvdiet plan`: the report's figures, its JSON, --compare, --plot and errors (issue: foundation, point 6)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvdiet.cache.spec import CacheSpec
from kvdiet.cli import main
from kvdiet.config import load_config
from kvdiet.planner.report import PlanOptions, plan_report
from kvdiet.weights import estimate_weights

REUSE_V41 = [
    *range(3, 8),
    *range(9, 14),
    *range(15, 20),
    21,
    22,
    23,
    25,
    26,
    27,
    29,
    30,
    31,
    33,
    34,
    35,
    37,
    38,
    39,
]


def _run_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json_real_v41(capsys, v41_path: Path) -> None:
    report = _run_json(capsys, str(v41_path))
    assert report["global_bytes_per_token"] == 890.0
    roles = report["layer_plan"]["roles"]
    assert roles == {
        "swa-only": [0, 1],
        "full": [2, 8, 14, 20],
        "reindex": [24, 28, 32, 36],
        "reuse": REUSE_V41,
    }
    assert report["layer_plan"]["trailing_ratio_entries"] == [0, 0, 0]
    assert report["window"]["bytes_per_request"] == 2_703_360
    assert report["all_full_bytes_per_token"] == 10_324.0
    assert report["components"]["encoder_bytes_per_token"] == 534.0
    by_tokens = {row["tokens"]: row["global_bytes"] for row in report["contexts"]}
    assert by_tokens == {4000: 3_560_000, 128_000: 113_920_000, 1_000_000: 890_000_000}
    policies = {row["policy"]: row for row in report["swa_policies"]}
    assert set(policies) == {
        "bounded-replay",
        "boundary-snapshot",
        "full-store",
        "checkpoint:4096",
        "exact-recompute",
    }
    assert policies["bounded-replay"]["amortised_bytes_per_token"] == 890.0
    assert policies["full-store"]["amortised_bytes_per_token"] == 890.0 + 40 * 528
    # a snapshot as the engine writes it at an even position (`CacheSpec.snapshot_bytes`): rings and their
    # positions, the tails' counts (their open rows are empty), 3 Engram ids, the frame
    snapshot = 2_703_360 + 40 * 128 * 8 + 3 * 8 + 3 * 8 + 16
    assert policies["boundary-snapshot"]["amortised_bytes_per_token"] == pytest.approx(890 + snapshot / 1024)
    assert policies["checkpoint:4096"]["amortised_bytes_per_token"] == pytest.approx(890 + snapshot / 4096)


def test_planner_takes_each_snapshot_at_its_position() -> None:
    """64 segments of 1,001 tokens: ``boundary-snapshot`` at the 64-token block boundary at or before each end (the
    engine's V4.1 block size), all even (no ratio-2 tail holds an open row there); ``checkpoint:1024`` at 1,024,
    2,048, ... (62 of them in 64,064 tokens). A period that is not a multiple of the block size is refused, as the
    engine refuses it."""
    cfg = load_config("deepseek-v4.1-flash")
    report = plan_report(cfg, PlanOptions(tokens_per_boundary=1001, checkpoint_every=1024))
    policies = {row["policy"]: row for row in report["swa_policies"]}
    even = 2_703_360 + 40 * 128 * 8 + 3 * 8 + 3 * 8 + 16
    tokens = 64 * 1001
    kv = CacheSpec.from_config(cfg).global_bytes(tokens)
    with pytest.raises(
        ValueError, match=r"checkpoint_every 1001 must be a multiple of deepseek-v4\.1-flash.s block"
    ):
        plan_report(cfg, PlanOptions(tokens_per_boundary=1001, checkpoint_every=1001))
    for name, stored in (
        ("boundary-snapshot", kv + 64 * even),
        ("checkpoint:1024", kv + tokens // 1024 * even),
    ):
        assert policies[name]["amortised_bytes_per_token"] == pytest.approx(stored / tokens, rel=1e-15), name
    assert policies["boundary-snapshot"]["block_size"] == 64
    assert policies["boundary-snapshot"]["tokens_per_boundary"] == 1001


@pytest.mark.parametrize("tokens", [512, 1000, 1024, 1100, 1500])
def test_planner_v4_flash_snapshots_at_its_128_token_blocks(tokens: int) -> None:
    """V4-Flash's engine runs 128-token blocks only, so each snapshot is one taken at a block boundary
    (4,118,872 B, never the 9.36 MB of a position between two HCA groups): its amortised bytes are the global
    KV plus 64 such snapshots (one per end, each at the boundary at or before it)."""
    cfg = load_config("deepseek-v4-flash")
    spec = CacheSpec.from_config(cfg)
    report = plan_report(cfg, PlanOptions(tokens_per_boundary=tokens))
    row = next(r for r in report["swa_policies"] if r["policy"] == "boundary-snapshot")
    assert spec.snapshot_bytes(128) == 4_118_872
    stored = spec.global_bytes(64 * tokens) + 64 * 4_118_872
    assert row["amortised_bytes_per_token"] == pytest.approx(stored / (64 * tokens), rel=1e-15)
    assert (row["block_size"], row["tokens_per_boundary"]) == (128, tokens)


@pytest.mark.parametrize("tokens", [1, 2, 63, 127])
def test_ends_closer_than_a_block_snapshot_once_a_block(tokens: int) -> None:
    """Ends every 1..127 tokens on V4-Flash's 128-token blocks: the session runs 64 blocks at least (64 ends 1
    token apart reached no block boundary: no snapshot, and bounded replay's bytes per token fell under its own
    global cache's), so boundary-snapshot stores one snapshot a block and bounded replay the global cache."""
    cfg = load_config("deepseek-v4-flash")
    spec = CacheSpec.from_config(cfg)
    rows = {r["policy"]: r for r in plan_report(cfg, PlanOptions(tokens_per_boundary=tokens))["swa_policies"]}
    session = tokens * -(-64 * 128 // tokens)  # whole segments, 8,192 tokens at least
    blocks = session // 128
    stored = spec.global_bytes(session) + blocks * spec.snapshot_bytes(128)
    assert rows["boundary-snapshot"]["amortised_bytes_per_token"] == pytest.approx(
        stored / session, rel=1e-15
    )
    replay = rows["bounded-replay"]["amortised_bytes_per_token"]
    assert replay == pytest.approx(spec.global_bytes(session) / session, rel=1e-15)
    assert replay >= spec.global_bytes_per_token * (1 - 1e-3)


def test_compare_ratio_is_monotone_in_tokens_per_boundary(capsys) -> None:
    """The V4.1 / V4 persistent ratio grows steadily with the tokens between ends (V4's snapshots amortised
    over more tokens): 1,000 and 1,024 differ by little, not 0.071 against 0.118 as when 1,000-token ends were
    charged 9.36 MB snapshots; the JSON names the tokens per boundary it used."""
    ratios = []
    for x, used in (
        ("512", 512),
        ("1000", 1000),
        ("1K", 1000),
        ("1Ki", 1024),
        ("1100", 1100),
        ("1.5K", 1500),
    ):
        out = _run_json(
            capsys, "--compare", "deepseek-v4.1-flash", "deepseek-v4-flash", "--tokens-per-boundary", x
        )
        ratios.append(out["ratios"]["persistent_bounded_replay_vs_boundary_snapshot"])
        assert out["tokens_per_boundary"] == used
    assert ratios == sorted(ratios) and ratios[1] == ratios[2] and len(set(ratios)) == 5
    assert ratios[3] - ratios[2] < 0.002  # 0.1166 and 0.1181
    assert round(ratios[3], 3) == 0.118


def test_capacity_arithmetic(capsys) -> None:
    report = _run_json(
        capsys,
        "deepseek-v4.1-flash",
        "--gpu",
        "b200",
        "--num-gpus",
        "4",
        "--weights-gb",
        "300",
        "--context",
        "1M",
    )
    cap = report["capacity"]
    assert (cap["gpu_mem_gb"], cap["num_gpus"], cap["weights_source"]) == (192.0, 4, "flag")
    per_session = 890_000_000 + 2_703_360 + 24_576
    assert cap["bytes_per_session"] == per_session
    assert cap["sessions"] == int((4 * 192e9 - 300e9) // per_session) == 524
    custom = _run_json(capsys, "v4.1-mini", "--gpu-mem-gb", "10", "--num-gpus", "1", "--weights-gb", "0")
    assert custom["capacity"]["gpu"] == "custom" and custom["capacity"]["kv_budget_gb"] == 10.0


def test_weights_estimate_in_range() -> None:
    v41 = estimate_weights(load_config("deepseek-v4.1-flash"))
    assert 540e9 < v41.params < 560e9  # release card: 552B (+196B Engram, host-resident)
    assert 190e9 < v41.engram_params < 200e9
    v1 = estimate_weights(load_config("deepseek-llm-67b"))
    assert 66e9 < v1.params < 68e9


def test_compare(capsys) -> None:
    out = _run_json(capsys, "--compare", "deepseek-v4.1-flash", "deepseek-v4-flash")
    assert out["ratios"]["global_bytes_per_token"] == pytest.approx(890 / 3514.25)
    assert out["a"]["config"] == "deepseek-v4.1-flash" and out["b"]["config"] == "deepseek-v4-flash"
    # the per-request state besides the window, which the "request at N" rows include
    tails = out["ratios"]["compressor_tail_bytes_per_request"]
    a_tail, b_tail = (out[k]["compressor_tail_bytes_per_request"] for k in "ab")
    assert b_tail == 12_206_080 and tails == pytest.approx(a_tail / b_tail)
    # bounded-replay V4.1 vs boundary-snapshot V4 at 1024 tokens per boundary: ≈ 1/8.5, a V4-Flash snapshot
    # counted as the engine writes it at a multiple of 128 tokens (`CacheSpec.snapshot_bytes`, as the trace
    # study counts it): 43 rings with int64 positions, 41 tails' counts, the 21 CSA layers' last complete
    # windows (4 rows of kv and score, 2 × (512 + 128) fp32 wide) and the frame
    snapshot = 43 * 128 * (584 + 8) + 41 * 8 + 21 * 2 * 4 * 2 * (512 + 128) * 4 + 16
    assert snapshot == 4_118_872
    r = out["ratios"]["persistent_bounded_replay_vs_boundary_snapshot"]
    assert r == pytest.approx(890 / (3514.25 + snapshot / 1024))
    assert round(r, 3) == 0.118
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert f"| persistent, V4.1 bounded-replay vs V4 boundary-snapshot | {r:.3f} (" in readme
    assert f"the planner gives {r:.3f}" in readme  # the study's section


def test_compare_text_states_its_capacity_assumptions(capsys, monkeypatch) -> None:
    """The text table's sessions row is read under one set of devices and context, which it names, with each
    config's own weights (a JSON reader has them in each report's ``capacity``)."""
    monkeypatch.setenv("COLUMNS", "400")  # one line, not the terminal's wrap
    argv = "plan --compare deepseek-v4.1-flash deepseek-v4-flash --gpu h100 --num-gpus 16 --context 64K"
    assert main(argv.split()) == 0
    text = capsys.readouterr().out
    assert "Capacity of both: 16 × h100 (80 GB), sessions of 64,000 tokens, after the weights: " in text
    assert "deepseek-v4.1-flash 298.05 GB (estimate), deepseek-v4-flash 155.37 GB (estimate)" in text


def test_text_output(capsys) -> None:
    assert main(["plan", "deepseek-v4.1-flash"]) == 0
    text = capsys.readouterr().out
    assert "890.00" in text and "10,324.00 (11.6×)" in text and "3–7, 9–13" in text


def test_plot(tmp_path: Path, capsys) -> None:
    out = tmp_path / "kv.png"
    assert main(["plan", "--plot", str(out), "--json"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert main(["plan", "--plot", str(tmp_path / "kv.txt")]) == 2
    assert "must end in .png" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["nope"], "neither a preset"),
        ([""], "'' is neither a preset"),  # an empty name is not the default preset
        (["v4.1-mini", "--compare", "a", "b"], "give one config or --compare A B, not both (got 'v4.1-mini'"),
        (["--contexts", "4K,abc"], "--contexts: cannot parse token count"),
        (["--contexts", "0,5"], "--contexts must be positive token counts, got [0, 5]"),
        (["--context", "0"], "--context must be > 0, got 0"),
        (["--context", "abc"], "--context: cannot parse token count 'abc'"),
        (["--num-gpus", "0"], "--num-gpus must be > 0, got 0"),
        (["--weights-gb", "-1"], "--weights-gb must be a finite number >= 0"),
        (["--checkpoint-every", "0"], "--checkpoint-every must be > 0"),
        (  # the engine refuses it (the plan printed a checkpoint:100 row)
            ["--checkpoint-every", "100"],
            "--checkpoint-every 100 must be a multiple of deepseek-v4.1-flash's block size 64",
        ),
        (
            ["--compare", "deepseek-v4.1-flash", "deepseek-v4-flash", "--checkpoint-every", "64"],
            "--checkpoint-every 64 must be a multiple of deepseek-v4-flash's block size 128",
        ),
        (["--tokens-per-boundary", "0"], "--tokens-per-boundary must be > 0"),
        (["--gpu-mem-gb", "nan"], "--gpu-mem-gb must be a finite number > 0"),
        (["--weights-gb", "inf"], "--weights-gb must be a finite number >= 0"),
        (
            ["--weights-gb", "1e300"],
            "--weights-gb must be a finite number >= 0 (finite in bytes), got 1e+300",
        ),
        (["--gpu-mem-gb", "1e300"], "--gpu-mem-gb must be a finite number > 0 (finite in bytes), got 1e+300"),
        (
            ["--num-gpus", str(10**400)],
            "--num-gpus × --gpu h200 is past the largest float64 (1.8e+308 bytes)",
        ),
    ],
)
def test_errors_exit_2(capsys, argv: list[str], needle: str) -> None:
    """Each bad value is one line naming the flag the user typed, never a PlanOptions field (issue ux41.5)."""
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvdiet plan: error: ") and needle in err and err.count("\n") == 1
    assert not any(
        f in err for f in ("num_gpus", "weights_gb", "capacity_context", "gpu_mem_gb", "checkpoint_every")
    )


def test_a_device_count_past_float64_names_the_gpu_flag_the_user_typed(capsys) -> None:
    """Without --gpu-mem-gb the device memory comes from --gpu (h200 by default): the error names that
    flag, not --gpu-mem-gb, which the user never typed."""
    for argv, names in (([], "--gpu h200"), (["--gpu", "b200"], "--gpu b200")):
        assert main(["plan", "--num-gpus", str(10**300), *argv]) == 2
        err = capsys.readouterr().err
        assert f"--num-gpus × {names} is past the largest float64" in err and "--gpu-mem-gb" not in err


def test_options_validation() -> None:
    with pytest.raises(ValueError, match="contexts must be positive"):
        plan_report(load_config("v4.1-micro"), PlanOptions(contexts=(0,)))


def test_weights_that_do_not_fit_warn(capsys) -> None:
    """Issue 18 point 5: ``0.0 GB for KV → 0 sessions`` with a warning, in the text, the JSON and on stderr."""
    assert main(["plan", "--num-gpus", "2", "--weights-gb", "5000"]) == 0
    out = capsys.readouterr().out
    assert "warning:" in out and "5,000.0 GB) do not fit in 2 × 141 GB = 282.0 GB" in " ".join(out.split())
    report = _run_json(capsys, "--num-gpus", "2", "--weights-gb", "5000")
    assert report["capacity"]["sessions"] == 0
    assert "do not fit" in report["capacity"]["warning"]
    assert main(["plan", "--num-gpus", "2", "--weights-gb", "5000", "--json"]) == 0
    assert "kvdiet plan: warning: deepseek-v4.1-flash: the weights" in capsys.readouterr().err
    # no weights and a device below one byte: nothing is left, but the weights are not what does not fit
    tiny = _run_json(capsys, "--gpu-mem-gb", "1e-12", "--weights-gb", "0")["capacity"]
    assert (tiny["sessions"], tiny["kv_budget_gb"]) == (0, 0.0)
    assert tiny["warning"].startswith("0.00 GB left for the KV cache after the weights holds no session")
    # room for weights but not for one 1M-token session
    small = _run_json(
        capsys, "--gpu-mem-gb", "1", "--num-gpus", "1", "--weights-gb", "0.5", "--context", "1M"
    )
    assert small["capacity"]["sessions"] == 0 and "holds no session" in small["capacity"]["warning"]
    assert _run_json(capsys)["capacity"]["warning"] is None


def test_plot_into_a_missing_directory_fails_first_and_creates_nothing(tmp_path: Path, capsys) -> None:
    target = tmp_path / "no" / "such" / "kv.png"
    assert main(["plan", "--plot", str(target)]) == 2
    captured = capsys.readouterr()
    assert f"the directory {str(target.parent)!r} does not exist" in captured.err and not captured.out
    assert not (tmp_path / "no").exists()
    (tmp_path / "file").write_text("")
    assert main(["plan", "--plot", str(tmp_path / "file" / "kv.png")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    # an empty name was ignored; a folder that takes no files (/proc) failed after the report was printed
    assert main(["plan", "--plot", ""]) == 2
    assert capsys.readouterr().err == "kvdiet plan: error: plot file '' must end in .png, .svg or .pdf\n"
    (tmp_path / "taken.png").mkdir()  # a folder under the plot's name: it cannot be opened for writing
    assert main(["plan", "--plot", str(tmp_path / "taken.png")]) == 2
    captured = capsys.readouterr()
    assert f"plot file {str(tmp_path / 'taken.png')!r}: is a directory" in captured.err and not captured.out
    assert (
        main(["plan", "--plot", str(tmp_path / "new.png"), "--json"]) == 0
    )  # the check leaves no file behind
    assert (tmp_path / "new.png").stat().st_size > 1000


def test_plan_and_replay_name_the_same_gpus(capsys) -> None:
    from kvdiet.planner.report import GPUS
    from kvdiet.sim.cost import GPU_FP8_FLOPS

    assert set(GPUS) == set(GPU_FP8_FLOPS)
    cap = _run_json(capsys, "--gpu", "h100")["capacity"]
    assert (cap["gpu"], cap["gpu_mem_gb"]) == ("h100", 80.0)


def test_gpu_names_are_case_insensitive_in_plan_and_replay(tmp_path: Path, capsys) -> None:
    """``--gpu H200`` was refused (argparse's choices are lower case) while ``h200`` worked."""
    cap = _run_json(capsys, "--gpu", "H100")["capacity"]
    assert (cap["gpu"], cap["gpu_mem_gb"]) == ("h100", 80.0)
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n')
    argv = ["replay", str(trace), "--runs", "bounded-replay", "--sweep", "none", "--json", "--jobs", "1"]
    assert main([*argv, "--gpu", "B200"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    assert run["config"]["gpu"] == "b200" and "B200" in run["summary"]["cost_formula"]


def test_a_context_past_max_position_embeddings_warns_but_runs(capsys) -> None:
    """Issue ux41.6: a warning on stderr and a ``context_warning`` field in --json, exit 0; none within it."""
    assert main(["plan", "--context", "2M", "--contexts", "4K,3M", "--json"]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    warning = (
        "context lengths past the model's max_position_embeddings 1,048,576: 3,000,000 (--contexts) and "
        "2,000,000 (--context); the bytes are extrapolated"
    )
    assert report["context_warning"].startswith(warning) and report["capacity"]["context"] == 2_000_000
    assert (
        out.err.startswith(f"kvdiet plan: warning: deepseek-v4.1-flash: {warning}")
        and out.err.count("\n") == 1
    )
    assert main(["plan", "--context", "1Mi"]) == 0  # exactly the limit: no warning, in text mode either
    assert capsys.readouterr().err == ""
    assert main(["plan", "--context", "1M", "--contexts", "2M"]) == 0  # text mode: stderr too
    assert "max_position_embeddings 1,048,576: 2,000,000 (--contexts); the bytes" in capsys.readouterr().err


@pytest.mark.parametrize("contexts", ["4K,,8K", "4K,"])
def test_an_empty_context_item_is_refused(capsys, contexts: str) -> None:
    """An empty item of --contexts is an error naming it (it was skipped), as generate's --prompt-ids does."""
    assert main(["plan", "--contexts", contexts]) == 2
    assert (
        capsys.readouterr().err
        == "kvdiet plan: error: --contexts: item 2 is empty (counts are comma-separated)\n"
    )


def test_huge_gpu_counts_give_exact_session_counts(capsys) -> None:
    """``--num-gpus 2**63`` is counted in whole bytes, not float64 (which got the last 7 digits wrong)."""
    n = 2**63
    cap = _run_json(capsys, "--num-gpus", str(n), "--weights-gb", "0")["capacity"]
    assert cap["num_gpus"] == n and cap["sessions"] == n * 141 * 10**9 // cap["bytes_per_session"]
    assert cap["kv_budget_gb"] == float(n * 141)  # 141 * 2**63 GB is a float64 exactly


def test_the_capacity_line_reads_like_its_warning(capsys) -> None:
    """The capacity line's figures carry thousands separators and the warning's rounding (829.95 GB on both)."""
    assert main(["plan", "--context", "10T"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "= 829.95 GB for KV → 0 sessions" in out and "829.95 GB left for the KV cache" in out
    # the line's own figures add up at its rounding: 8 × 141 − 298.05 = 829.95 (298.0 did not)
    total, weights, budget = re.search(
        r"\(([\d.]+) GB\) − weights ([\d.]+) GB \(estimate\) = ([\d.]+) GB", out
    ).groups()
    assert round(8 * float(total) - float(weights), 2) == float(budget)
    assert main(["plan", "--num-gpus", "1000000"]) == 0
    assert "Capacity: 1,000,000 × h200 (141 GB)" in " ".join(capsys.readouterr().out.split())


def test_huge_weights_print_in_scientific_notation(capsys) -> None:
    """``--weights-gb 1e30`` printed a 40-digit figure on the capacity line and in its warning."""
    assert main(["plan", "--weights-gb", "1e30"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "− weights 1.000e+30 GB (flag) = 0.00 GB for KV → 0 sessions" in out
    assert "the weights (1.000e+30 GB) do not fit in 8 × 141 GB = 1,128.0 GB" in out


def test_a_bad_config_file_is_named_in_its_error(capsys, tmp_path) -> None:
    """``plan --compare bad.json deepseek-v4-flash`` said ``vocab_size must be > 0, got 0``: of which config?"""
    import json

    from kvdiet.config import PRESETS, config_dir

    raw = json.loads((config_dir() / PRESETS["deepseek-v4.1-flash"]).read_text())
    raw.get("text_config", raw)["vocab_size"] = 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(raw))
    assert main(["plan", "--compare", str(bad), "deepseek-v4-flash"]) == 2
    assert capsys.readouterr().err == f"kvdiet plan: error: {bad}: vocab_size must be > 0, got 0\n"


def test_the_global_kv_table_splits_its_total_by_encoder_and_decoder(capsys, v41_path: Path) -> None:
    """The encoder/decoder split follows the total it splits (it read as a part of the index keys' 170 B)."""
    assert main(["plan", str(v41_path)]) == 0
    out = capsys.readouterr().out
    table = out[out.index("Global KV per token") :]
    rows = [line for line in table.splitlines() if "│" in line]
    names = [row.split("│")[1].strip() for row in rows]
    at = names.index("total")
    assert names[at + 1 : at + 3] == ["of the total: encoder layers", "of the total: decoder layers"]
    split = [float(rows[at + i].split("│")[2].replace(",", "")) for i in (1, 2)]
    assert sum(split) == pytest.approx(float(rows[at].split("│")[2].replace(",", "")))
