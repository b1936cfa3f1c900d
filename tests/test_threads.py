"""`kvdiet.threads`: the cores a process may use, the bounded OpenMP spin set before torch loads (and an
explicit choice kept), and ``--threads``."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time

import pytest
import torch

from kvdiet.cli import main
from kvdiet.threads import (
    CONTENDED_SHARE,
    SPIN_COUNT,
    AdaptiveThreads,
    adapt_threads,
    available_cores,
    bound_spinning,
    max_threads,
    run_queue_wait_ns,
    set_threads,
)


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


class _Clock:
    """A clock and a run-queue wait the test moves by hand."""

    def __init__(self) -> None:
        self.now, self.wait = 0.0, 0

    def step(self, seconds: float, waited: float) -> None:
        self.now += seconds
        self.wait += int(waited * 1e9)


def _adaptive(threads: int, clock: _Clock, sizes: list[int]) -> AdaptiveThreads:
    return AdaptiveThreads(
        threads, clock=lambda: clock.now, read_wait=lambda: clock.wait, interval=0.1, resize=sizes.append
    )


def test_the_pool_halves_while_the_model_waits_for_a_cpu_and_grows_back_when_it_does_not() -> None:
    clock, sizes = _Clock(), []
    pool = _adaptive(8, clock, sizes)
    clock.step(0.5, 0.2)  # 40% of the time on a run queue
    assert pool.check() == 4 and sizes == [4]
    clock.step(0.05, 0.05)  # asked again before the interval: no look
    assert pool.check() == 4 and sizes == [4]
    clock.step(0.1, 0.05)  # (0.05 + 0.05) / 0.15: still contended
    assert pool.check() == 2
    clock.step(0.2, 0.1)
    assert pool.check() == 1
    clock.step(0.2, 0.1)
    assert pool.check() == 1 and sizes == [4, 2, 1]  # never below one
    clock.step(0.2, 0.01)  # 5%: between the two shares, kept
    assert pool.check() == 1
    clock.step(0.2, 0.002)  # 1%: the cores are free again
    assert pool.check() == 2
    clock.step(0.2, 0.0)
    assert pool.check() == 4
    clock.step(0.2, 0.0)
    assert pool.check() == 8
    clock.step(0.2, 0.0)
    assert pool.check() == 8 and sizes == [4, 2, 1, 2, 4, 8] and pool.resizes == 6  # never past the default


def test_without_a_run_queue_wait_the_pool_keeps_its_size() -> None:
    sizes: list[int] = []
    pool = AdaptiveThreads(
        4, clock=lambda: 10.0 * len(sizes) + time.monotonic(), read_wait=lambda: None, resize=sizes.append
    )
    assert pool.check() == 4 and sizes == []
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        AdaptiveThreads(0, read_wait=lambda: 0, resize=sizes.append)


def _busy() -> None:
    while True:
        pass


@pytest.mark.skipif(run_queue_wait_ns() is None, reason="no /proc/thread-self/schedstat")
def test_the_run_queue_wait_grows_only_while_other_processes_take_the_cores() -> None:
    def share() -> float:
        start, wait = time.monotonic(), run_queue_wait_ns()
        while time.monotonic() - start < 0.4:
            pass
        return (run_queue_wait_ns() - wait) / 1e9 / (time.monotonic() - start)

    load = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(2 * available_cores())]
    for p in load:
        p.start()
    try:
        loaded = share()
    finally:
        for p in load:
            p.terminate()
            p.join()
    assert loaded > CONTENDED_SHARE  # two busy processes a core: this thread waits most of the time
    assert share() < loaded / 2


def test_only_a_default_sized_pool_adapts() -> None:
    before = torch.get_num_threads()
    try:
        set_threads(1)
        assert adapt_threads() is None
        set_threads(None)
        assert adapt_threads() == available_cores()  # asked at once: no look yet, the default size
    finally:
        set_threads(1)  # no adaptive pool left behind for other tests
        torch.set_num_threads(before)


@pytest.mark.parametrize("model", ["v4.1-mini", "v4-mini"])
def test_a_prefill_and_decode_steps_have_the_same_bits_at_one_and_two_threads(model: str) -> None:
    """What lets the pool shrink under contention without changing a result: the same logits, bit for bit."""
    from kvdiet.model.build import load_model

    m, _ = load_model(model, seed=0)
    ids = [(7919 * i) % 50_000 + 1 for i in range(300)]
    before, logits = torch.get_num_threads(), {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            state = m.new_state(m.new_pool(8))
            rows = [m.prefill(state, torch.tensor(ids))]
            for _ in range(3):
                rows.append(
                    m.decode([state], [int(rows[-1].reshape(-1, rows[-1].shape[-1])[-1].argmax())])[0]
                )
            logits[threads] = torch.stack([r.reshape(-1, r.shape[-1])[-1] for r in rows])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(logits[1], logits[2])
