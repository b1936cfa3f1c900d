"""kvdiet against DeepSeek's own reference outputs on a checkpoint in the released format (shared/golden).

The directory is loaded unchanged. When it is missing the test fails in CI (CI=true) and skips elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiet.model.golden import compare_golden

GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "golden" / "tiny-fp8"


@pytest.fixture(scope="module")
def golden() -> Path:
    if not (GOLDEN / "reference_outputs.safetensors").is_file():
        if os.environ.get("CI"):
            pytest.fail(f"{GOLDEN} is missing: CI must have ../shared/golden")
        pytest.skip(f"{GOLDEN} is not on this machine")
    return GOLDEN


def test_released_checkpoint_matches_deepseeks_reference(golden: Path) -> None:
    r = compare_golden(golden)
    assert r.numerics == "fp8"  # from the checkpoint's quantization_config
    assert r.rows == 64 and r.rows_within_tol >= 0.95 * 64 and r.worst_rel < 1e-3
    assert r.argmax_equal == 64
    assert set(r.topk_rows_equal) == {2, 3, 4, 5, 6, 7, 8, 9, 10, 11}
    assert all(n == 64 for n in r.topk_rows_equal.values())
    assert r.caches and all(diff == 0.0 for diff in r.caches.values())  # bit-identical after the prompt
    assert r.decode_steps == 16 and r.decode_tokens_equal == 16 and r.decode_rows_within_tol == 16
    # every decode step kvdiet misses by itself is one FP8 activation a few ulps from an E4M3 midpoint
    assert all(tie["ulps"] <= 4 for _, tie in r.rounding_ties)
    assert len(r.rounding_ties) <= 2  # isolated, never a systematic difference
    assert r.accepted


def test_bf16_numerics_miss_the_fp8_reference(golden: Path) -> None:
    # Without FP8 activation quantisation the same weights compute other numbers (the 0/64 rows).
    r = compare_golden(golden, numerics="bf16")
    assert r.numerics == "bf16" and r.rows_within_tol == 0 and r.argmax_equal < 48 and not r.accepted


def test_golden_command_json_and_check(golden: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "kvdiet.cli", "golden", str(golden), "--json", "--check"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    for key in (
        "rows",
        "rows_within_tol",
        "worst_rel",
        "argmax_equal",
        "decode_steps",
        "decode_tokens_equal",
    ):
        assert key in out
    assert out["topk_rows_equal"]["6"] == 64 and out["accepted"] is True


def test_golden_command_errors_in_one_line(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "kvdiet.cli", "golden", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 2
    assert run.stderr.strip() == f"kvdiet golden: error: no reference_outputs.safetensors in {tmp_path}"


def test_damaged_or_incomplete_golden_folders_are_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"^{tmp_path / 'nowhere'}: no such folder$"):
        compare_golden(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(
        FileNotFoundError, match=f"^{tmp_path / 'file'}: a file, not a folder$"
    ):  # was "no such"
        compare_golden(tmp_path / "file")
    (tmp_path / "reference_outputs.safetensors").write_bytes(b"\x10" + b"\x00" * 99)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        compare_golden(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        compare_golden(tmp_path)
    with pytest.raises(ValueError, match="finite number > 0"):
        compare_golden(tmp_path, tol=float("inf"))
