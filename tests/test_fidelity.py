"""`kvdiet fidelity`: each measure on cases with a known answer, and the command."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvdiet.model.attention as attention_module
from kvdiet.config import load_config
from kvdiet.fidelity.experiments import (
    cache_precision,
    csa2_selection,
    prefill_rows,
    replay,
)
from kvdiet.fidelity.measures import (
    continuation_agreement,
    kl_divergence,
    max_abs_delta,
    set_overlap,
    top1_agreement,
)
from kvdiet.model.transformer import Transformer

PROMPT = torch.tensor([3 + (i * 7) % 60 for i in range(96)])


@pytest.fixture
def micro() -> Transformer:
    return Transformer.from_config(load_config("v4.1-micro"), seed=2)


def test_measures_by_hand() -> None:
    exact = torch.tensor([[0.0, math.log(3.0)], [1.0, 0.0]])
    approx = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    want = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)  # P = (¼, ¾), Q = (½, ½)
    assert kl_divergence(exact, approx).tolist() == pytest.approx(
        [want, 0.0], rel=1e-6, abs=1e-12
    )  # fp32 log 3
    assert kl_divergence(exact, exact).tolist() == [0.0, 0.0]
    assert top1_agreement(exact, approx).tolist() == [0.0, 1.0]
    assert max_abs_delta(exact, approx).tolist() == pytest.approx([math.log(3.0), 0.0])
    a = torch.tensor([[1, 2, 3, 4], [7, 8, 0, 0]])
    b = torch.tensor([[4, 2, 5, 6], [8, 7, 9, 9]])
    valid = torch.tensor([[True] * 4, [True, True, False, False]])
    assert set_overlap(a, valid, b, valid).tolist() == [0.5, 1.0]
    assert set_overlap(a, valid, a, torch.zeros_like(valid)).tolist() == [1.0, 1.0]  # empty reference
    assert continuation_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert continuation_agreement([5, 6], [5, 6]) == 1.0


def test_identical_paths_give_kl_zero_and_overlap_one(micro: Transformer, monkeypatch) -> None:
    # every "variant" quantises nothing: each is the fp32-cache run again
    monkeypatch.setattr("kvdiet.fidelity.experiments.VARIANTS", {"none": ()})
    points = cache_precision(micro, [PROMPT], [32, 64, 96], rows=8, chunk=32)
    by = {(p.measure, p.context): p.value for p in points}
    assert all(by[("kl", c)] == 0.0 and by[("max_abs_dlogit", c)] == 0.0 for c in (32, 64, 96))
    assert all(by[("top1", c)] == 1.0 for c in (32, 64, 96))
    overlaps = [p for p in points if p.measure.startswith("topk_overlap")]
    assert overlaps and all(p.value == 1.0 for p in overlaps)


def test_an_exactly_representable_cache_gives_zero_error(micro: Transformer, monkeypatch) -> None:
    # window entries of zero (wkv = 0) are exact in FP8: the FP8-window variant changes nothing at all
    for block in micro.layers:
        block.attn.wkv.weight.data.zero_()
    monkeypatch.setattr("kvdiet.fidelity.experiments.VARIANTS", {"fp8 window": ("window",)})
    points = cache_precision(micro, [PROMPT], [64, 96], rows=8, chunk=32)
    assert {p.value for p in points if p.measure in ("kl", "max_abs_dlogit")} == {0.0}
    monkeypatch.setattr("kvdiet.fidelity.experiments.VARIANTS", {"fp4 main KV": ("main",)})
    main = cache_precision(micro, [PROMPT], [96], rows=8, chunk=32)
    assert next(p.value for p in main if p.measure == "max_abs_dlogit") > 0  # the control: FP4 main KV is not


def test_a_forced_selection_change_gives_the_computed_overlap(micro: Transformer, monkeypatch) -> None:
    import kvdiet.fidelity.experiments as experiments

    wanted = set(range(88, 96))
    base: dict[tuple[int, int], set[int]] = {}
    with micro.observe_selection(lambda s: _record(s, base, wanted)):
        prefill_rows(micro, PROMPT, [96], rows=8, chunk=32)
    real_select, real_prefill = attention_module.select_topk, experiments.prefill_rows
    runs = {"n": 0}

    def forced(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx, valid = real_select(scores, k)
        if runs["n"] == 1:  # the variant run (the baseline is the first): each row loses its first entry
            valid = valid.clone()
            valid[:, 0] = False
        return idx, valid

    def counting(*args, **kwargs):
        out = real_prefill(*args, **kwargs)
        runs["n"] += 1
        return out

    monkeypatch.setattr(attention_module, "select_topk", forced)
    monkeypatch.setattr(experiments, "prefill_rows", counting)
    monkeypatch.setattr(experiments, "VARIANTS", {"forced": ()})
    points = cache_precision(micro, [PROMPT], [96], rows=8, chunk=32)
    # Layer 1 is the first index source: its scores do not depend on any selection, so its overlap is exactly
    # the mean of (s − 1) / s over the rows' selection sizes s.
    sizes = [len(sel) for (layer, _pos), sel in base.items() if layer == 1]
    want = sum((s - 1) / s for s in sizes) / len(sizes)
    assert next(p.value for p in points if p.measure == "topk_overlap_L1") == pytest.approx(want, abs=1e-12)
    assert want < 1.0


def _record(sel, store: dict, wanted: set[int]) -> None:
    if sel.attn.indexer is None:
        return
    for r, pos in enumerate(sel.seg.positions.tolist()):
        if pos in wanted:
            store[(sel.attn.info.layer_id, pos)] = set(sel.idx[r][sel.valid[r]].tolist())


def test_csa2_measures_cover_every_role(micro: Transformer) -> None:
    points = csa2_selection(micro, [PROMPT], [64, 96], rows=8, chunk=32)
    variants = {p.variant for p in points}
    assert {"reuse L2 vs own attention", "reindex L7 vs L5", "candidate pool recall L7"} <= variants
    assert all(0.0 <= p.value <= 1.0 and p.n == 8 for p in points)


def test_each_experiment_reports_each_prompt_it_measures(micro: Transformer) -> None:
    """``done()`` once per prompt an experiment measures (the command's progress lines count them): a prompt
    shorter than every context is not measured, so not counted."""
    short = PROMPT[:20]
    calls = {"cache": 0, "csa2": 0, "replay": 0}

    def counter(name: str):
        return lambda: calls.__setitem__(name, calls[name] + 1)

    cache_precision(micro, [PROMPT, short, PROMPT[:64]], [32, 64], rows=8, chunk=32, done=counter("cache"))
    csa2_selection(micro, [PROMPT, short], [32, 64], rows=8, chunk=32, done=counter("csa2"))
    replay(micro, [short, PROMPT], [32], rows=8, chunk=32, hits=[], continuation=2, done=counter("replay"))
    assert calls == {"cache": 2, "csa2": 1, "replay": 1}


def test_replay_on_a_prompt_inside_one_window_is_exact(micro: Transformer) -> None:
    short = PROMPT[:8]  # no longer than the window: the decoder sees every row either way
    points = replay(micro, [short], [8], rows=8, chunk=8, hits=[], continuation=4)
    by = {(p.variant, p.measure): p.value for p in points}
    assert by[("decoder-side", "kl")] == 0.0 and by[("decoder-side", "continuation")] == 1.0
    longer = replay(micro, [PROMPT], [96], rows=8, chunk=32, hits=[16, 64], continuation=4)
    enc = [p for p in longer if p.variant == "encoder-side"]
    assert {p.hit for p in enc} == {16, 64} and all(p.context == 96 for p in enc)
    assert all(0.0 <= p.value <= 1.0 for p in enc if p.measure in ("top1", "continuation"))


def test_fidelity_command_json_and_report(tmp_path: Path) -> None:
    ids = ",".join(str(3 + (i * 7) % 60) for i in range(96))
    cmd = [sys.executable, "-m", "kvdiet.cli", "fidelity", "--model", "v4.1-micro", "--prompt-ids", ids]
    cmd += ["--contexts", "32,64,96", "--rows", "8", "--chunk", "32", "--hits", "16,64"]
    cmd += ["--continuation", "3"]
    run = subprocess.run(
        [*cmd, "--json", "--report", str(tmp_path / "r")], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["random_weights"] and "not the released model" in out["caveat"]
    assert out["hits"] == [16, 64] and out["contexts"] == [32, 64, 96]
    assert {p["variant"] for p in out["cache_precision"]} == {
        "fp4 main KV",
        "mxfp4 index keys",
        "fp8 window",
        "all three",
    }
    for name in ("report.md", "cache_precision.png", "selection.png", "replay.png"):
        assert (tmp_path / "r" / name).stat().st_size > 0
    assert "random weights (seed 0)" in (tmp_path / "r" / "report.md").read_text()
    bad = subprocess.run([*cmd, "--rows", "9"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "exceeds the sliding window 8" in bad.stderr
    missing = subprocess.run([*cmd[:4], "--prompts", str(tmp_path / "none")], capture_output=True, text=True)
    assert missing.returncode == 2 and "no such file or folder" in missing.stderr


def test_a_prompt_file_that_is_not_utf8_is_refused_by_name(tmp_path: Path) -> None:
    """A binary among the prompts: one line naming it (was read as U+FFFD and run as a prompt)."""
    import argparse

    from kvdiet.fidelity.command import _prompts

    good, binary = tmp_path / "a.txt", tmp_path / "b.txt"
    good.write_text("plain text")
    binary.write_bytes(b"\xff\xfe\x00")
    args = argparse.Namespace(prompt_ids=None, model="v4.1-mini")
    with pytest.raises(
        ValueError, match=rf"^--prompts {binary}: not UTF-8 text \(invalid start byte at byte 0\)$"
    ):
        _prompts(args, None, [binary, good], object(), limit=2)  # refused before any tokenizing


def test_prompts_that_are_not_a_file_or_folder_are_named_as_such() -> None:
    """``--prompts /dev/zero`` was "no such file or folder" for a path that exists."""
    from kvdiet.fidelity.command import _prompt_files

    with pytest.raises(ValueError, match=r"^--prompts /dev/zero: not a regular file or a folder$"):
        _prompt_files("/dev/zero")


def test_default_hit_lengths_and_prompts_too_short() -> None:
    from kvdiet.fidelity.command import _hits

    assert _hits(None, window=128, top=1000) == [192, 896]  # blocks of 64: just above the window, one short
    assert _hits(None, window=8, top=96) == [10, 94]  # a short context: any even length
    assert _hits(None, window=8, top=10) == []
    ids = ",".join(str(3 + i % 60) for i in range(20))
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvdiet.cli",
            "fidelity",
            "--model",
            "v4.1-micro",
            "--prompt-ids",
            ids,
            "--contexts",
            "64",
            "--rows",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (
        run.returncode == 2
        and "no prompt reaches the shortest context 64 (the longest has 20 tokens)" in run.stderr
    )


def test_default_rows_fit_a_short_window(capsys) -> None:
    """Issue ux41.4: v4.1-micro's window is 8, so ``--rows``' default (16) becomes 8 there; a given ``--rows``
    beyond the window is still one line naming it and the limit."""
    from kvdiet.cli import main

    ids = ",".join(str(3 + i % 60) for i in range(40))
    argv = ["fidelity", "--model", "v4.1-micro", "--prompt-ids", ids, "--contexts", "16", "--chunk", "16"]
    assert main([*argv, "--continuation", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 8
    assert main([*argv, "--rows", "16"]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == "kvdiet fidelity: error: --rows 16 exceeds the sliding window 8 (bounded replay keeps that many)\n"
    )


def test_contexts_past_the_models_positions_are_refused_before_the_work(capsys) -> None:
    """v4.1-micro holds 256 positions: a 256-token context leaves no room for the replay's continuation, which
    is refused up front naming both flags (it failed after the measurements, naming neither); the JSON lists
    only the contexts some prompt reaches."""
    from kvdiet.cli import main

    ids = ",".join(str(3 + i % 60) for i in range(256))
    argv = ["fidelity", "--model", "v4.1-micro", "--prompt-ids", ids, "--contexts", "16,256", "--chunk", "64"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "kvdiet fidelity: error: --contexts 256 + --continuation 8 = 264 tokens > max_position_embeddings 256: "
        "lower either\n"
    )
    short = ",".join(str(3 + i % 60) for i in range(40))
    argv = ["fidelity", "--model", "v4.1-micro", "--prompt-ids", short, "--contexts", "16,256,512"]
    assert main([*argv, "--chunk", "16", "--continuation", "1", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["contexts"] == [16]
    assert "kvdiet fidelity: --contexts 256, 512 skipped: the longest prompt has 40 tokens\n" in out.err


def test_an_empty_context_item_is_refused(capsys) -> None:
    """An empty item of --contexts is an error naming it (it was skipped), before the model loads."""
    from kvdiet.cli import main

    argv = ["fidelity", "--model", "v4.1-micro", "--prompt-ids", "1,2", "--contexts", "4,,8"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "kvdiet fidelity: error: --contexts: item 2 is empty (counts are comma-separated)\n"
    )


def test_a_v4_flash_config_and_a_bad_token_id_are_refused_before_the_model_loads(capsys, monkeypatch) -> None:
    """fidelity's experiments are V4.1's: a V4-Flash preset is refused by name (it crashed on the codecs after the
    model loaded), and --prompt-ids names its bad item as generate does, both before any model is built."""
    import kvdiet.model.build
    from kvdiet.cli import main

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(kvdiet.model.build, "load_model", no_load)
    argv = ["fidelity", "--model", "v4-mini", "--prompt-ids", "1,2,3", "--contexts", "2"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "kvdiet fidelity: error: --model v4-mini: kvdiet fidelity measures DeepSeek-V4.1's caches, CSA2 sharing"
        " and bounded replay; this is a V4-Flash config (give a V4.1 one, e.g. v4.1-mini)\n"
    )
    argv = ["fidelity", "--model", "v4.1-micro", "--prompt-ids", "3,4,...", "--contexts", "2"]
    assert main(argv) == 2
    assert (
        capsys.readouterr().err == "kvdiet fidelity: error: --prompt-ids: item 3 ('...') is not an integer\n"
    )


def test_coinciding_report_lines_are_drawn_once_and_named_together() -> None:
    """Selection variants that coincide (every one at 1.0 at a single context) are one line with one legend entry
    naming them all, as the replay report does; a line that differs keeps its own."""
    import matplotlib.pyplot as plt

    from kvdiet.fidelity.experiments import Point
    from kvdiet.fidelity.report import _plot

    points = [Point("csa2", v, "overlap", 256, value, 4) for v, value in (("a", 1.0), ("b", 1.0), ("c", 0.5))]
    fig, ax = plt.subplots()
    try:
        _plot(ax, points, "selection", "share")
        assert len(ax.get_lines()) == 2
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a\n= b (identical)", "c"]
    finally:
        plt.close(fig)
