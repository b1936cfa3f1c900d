"""`kvdiet.threads`: the cores a process may use, the bounded OpenMP spin set before torch loads (and an
explicit choice kept), and ``--threads``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvdiet.cli import main
from kvdiet.threads import SPIN_COUNT, available_cores, bound_spinning, max_threads, set_threads


def test_available_cores_is_this_process_affinity() -> None:
    assert available_cores() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, {"GOMP_SPINCOUNT": SPIN_COUNT}),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"}),
        ({"OMP_WAIT_POLICY": ""}, {"OMP_WAIT_POLICY": ""}),  # empty: OpenMP's own default, on purpose
        ({"GOMP_SPINCOUNT": "7"}, {"GOMP_SPINCOUNT": "7"}),
    ],
)
def test_the_spin_is_bounded_before_torch_loads_unless_the_environment_chooses(
    env: dict[str, str], want: dict[str, str]
) -> None:
    code = (
        "import os, sys; from kvdiet.threads import bound_spinning; took = bound_spinning(); "
        "print(took, repr(os.environ.get('OMP_WAIT_POLICY')), repr(os.environ.get('GOMP_SPINCOUNT')))"
    )
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=clean | env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["True", repr(want.get("OMP_WAIT_POLICY")), repr(want.get("GOMP_SPINCOUNT"))]


def test_too_late_once_torch_is_loaded() -> None:
    assert "torch" in sys.modules and bound_spinning() is False


def test_set_threads_sizes_torchs_pool_and_refuses_zero_and_too_many() -> None:
    before = torch.get_num_threads()
    try:
        assert set_threads(1) == 1 and torch.get_num_threads() == 1
        assert set_threads(None) == available_cores() == torch.get_num_threads()
        for bad in (0, max_threads() + 1):
            with pytest.raises(
                ValueError, match=rf"--threads must be between 1 and {max_threads()} .*, got {bad}"
            ):
                set_threads(bad)
    finally:
        torch.set_num_threads(before)


def test_the_threads_flag_reaches_torch_and_a_bad_one_is_one_line(capsys) -> None:
    before = torch.get_num_threads()
    try:
        base = ["generate", "--model", "v4.1-micro", "--prompt-ids", "1,2,3", "--max-tokens", "1"]
        assert main([*base, "--persistent-dir", "none", "--threads", "1", "--json"]) == 0
        assert torch.get_num_threads() == 1
        assert main([*base, "--threads", "0"]) == 2
        err = capsys.readouterr().err.strip()
        assert (
            err
            == f"kvdiet generate: error: --threads must be between 1 and {max_threads()} (4 per core), got 0"
        )
    finally:
        torch.set_num_threads(before)
