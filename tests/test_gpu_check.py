"""``benchmarks/gpu_check.sh``'s command line (issue ux41.8): ``-h``/``--help`` print the usage and run nothing;
an unknown argument is one usage line, one error line and status 2 (the check itself needs a GPU: not run here)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_prints_usage_and_runs_nothing(tmp_path: Path, flag: str) -> None:
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "DEVICE": "cpu", "PYTHON": "false"}
    run = subprocess.run(["bash", str(SCRIPT), flag], capture_output=True, text=True, env=env, timeout=30)
    assert (run.returncode, run.stderr) == (0, "")
    lines = run.stdout.splitlines()
    assert lines[0].startswith("usage: ") and "bash benchmarks/gpu_check.sh" in lines[0]
    assert lines[2].startswith("The GPU check of issue 16") and "DEVICE=cpu is the dry run" in run.stdout
    assert not (tmp_path / "out").exists()  # no step ran: $OUT was never made


@pytest.mark.parametrize(
    ("args", "named"),
    [(["--device"], "--device"), (["", "--x"], " --x"), (["--help", "extra"], "--help extra")],
)
def test_an_unknown_argument_is_an_error(tmp_path: Path, args: list[str], named: str) -> None:
    """Any argument but one -h/--help, an empty one included, is refused before anything runs."""
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")}
    run = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=30)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines()[1] == f"gpu_check: error: unrecognized arguments: {named}"
    assert not (tmp_path / "out").exists()
