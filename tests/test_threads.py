"""`kvdiet.threads`: the cores a process may use, the bounded OpenMP spin set before torch loads (and an
explicit choice kept), and ``--threads``."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from kvdiet.cli import main
from kvdiet.threads import (
    CONTENDED_SHARE,
    MIN_RUNNABLE_S,
    MKL_CBWR,
    SPIN_COUNT,
    AdaptiveThreads,
    adaptive_threads,
    available_cores,
    bound_spinning,
    max_threads,
    reproducible_blas,
    schedstat,
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


@pytest.mark.parametrize("preset", [None, "COMPATIBLE", ""])
def test_importing_kvdiet_asks_mkl_for_thread_count_independent_products_unless_the_environment_chooses(
    preset: str | None,
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    if preset is not None:
        env["MKL_CBWR"] = preset
    code = "import os, kvdiet; print(repr(os.environ.get('MKL_CBWR')))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == repr(MKL_CBWR if preset is None else preset)


def test_a_product_that_mkl_may_split_by_threads_has_the_same_bits_at_one_and_two() -> None:
    """The mHC coefficients' product of a prefill chunk ([300, 1024] · [1024, 24]): on an Intel Xeon, MKL's default
    mode gave other bits at 2 threads than at 1 (`kvdiet.threads`); the suite runs with kvdiet imported."""
    if not reproducible_blas():
        pytest.skip(f"the environment chose MKL's mode: MKL_CBWR={os.environ['MKL_CBWR']!r}")
    gen = torch.Generator().manual_seed(0)
    x, fn = torch.randn(300, 1024, generator=gen), torch.randn(24, 1024, generator=gen)
    before, out = torch.get_num_threads(), {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out[threads] = torch.mm(x, fn.T)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out[1], out[2])


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


class _Thread:
    """A clock and a thread's schedstat figures the test moves by hand."""

    def __init__(self) -> None:
        self.now, self.ran, self.waited = 0.0, 0, 0

    def step(self, seconds: float, ran: float, waited: float) -> None:
        self.now += seconds
        self.ran += int(ran * 1e9)
        self.waited += int(waited * 1e9)

    def pool(self, threads: int, sizes: list[int], grow_after: int = 2) -> AdaptiveThreads:
        return AdaptiveThreads(
            threads,
            clock=lambda: self.now,
            read=lambda: (self.ran, self.waited),
            interval=0.1,
            grow_after=grow_after,
            resize=sizes.append,
        )


def test_the_pool_halves_while_the_model_waits_for_a_cpu_and_grows_back_after_clear_looks() -> None:
    t, sizes = _Thread(), []
    pool = t.pool(8, sizes)
    t.step(0.5, 0.3, 0.2)  # waited 40% of its runnable time
    assert pool.check() == 4 and sizes == [4]
    t.step(0.05, 0.03, 0.02)  # asked again before the interval: no look
    assert pool.check() == 4 and sizes == [4]
    t.step(0.1, 0.06, 0.03)  # (0.02 + 0.03) of 0.14 s: still contended
    assert pool.check() == 2
    t.step(0.2, 0.1, 0.1)
    assert pool.check() == 1
    t.step(0.2, 0.1, 0.1)
    assert pool.check() == 1 and sizes == [4, 2, 1]  # never below one
    t.step(0.2, 0.19, 0.01)  # 5%: between the two shares, kept
    assert pool.check() == 1
    t.step(0.2, 0.2, 0.001)  # clear once: not yet
    assert pool.check() == 1
    t.step(0.2, 0.2, 0.001)  # twice in a row: doubled
    assert pool.check() == 2
    t.step(0.2, 0.2, 0.0)
    assert pool.check() == 2
    t.step(0.2, 0.2, 0.02)  # a look between the shares breaks the run of clear ones
    assert pool.check() == 2
    t.step(0.2, 0.2, 0.0)  # so one clear look after it is not yet two in a row
    assert pool.check() == 2
    t.step(0.2, 0.2, 0.0)
    assert pool.check() == 4
    t.step(0.2, 0.2, 0.0)
    t.step(0.0, 0.0, 0.0)
    assert pool.check() == 4
    t.step(0.2, 0.1, 0.1)  # a contended look breaks the run too (and halves)
    assert pool.check() == 2
    t.step(0.2, 0.2, 0.0)
    assert pool.check() == 2
    t.step(0.2, 0.2, 0.0)
    assert pool.check() == 4
    for _ in range(6):
        t.step(0.2, 0.2, 0.0)
        pool.check()
    assert (
        pool.current == 8 and sizes == [4, 2, 1, 2, 4, 2, 4, 8] and pool.resizes == 8
    )  # never past the default


def test_time_asleep_counts_for_nothing() -> None:
    # an idle server's engine thread sleeps between requests: a long wall time with little runnable time is no
    # decision, clear or contended, and its figures add up with the next ones
    t, sizes = _Thread(), []
    pool = t.pool(4, sizes, grow_after=1)
    t.step(0.5, 0.3, 0.2)
    assert pool.check() == 2
    t.step(30.0, 0.009, 0.0)  # asleep but for 9 ms: no decision (it would read clear and grow)
    assert pool.check() == 2 and sizes == [2]
    t.step(0.2, 0.006, 0.006)  # 21 ms runnable since the last decision, 6 of them waiting: contended
    assert pool.check() == 1 and sizes == [2, 1]
    t.step(0.2, MIN_RUNNABLE_S, 0.0)  # clear (grow_after 1)
    assert pool.check() == 2
    t.ran -= 10**9  # figures that went backwards (another thread under a reused id): start afresh
    t.step(0.2, 0.1, 0.1)
    assert pool.check() == 2 and sizes == [2, 1, 2]


def test_a_look_from_another_thread_starts_afresh() -> None:
    # the command builds the pool on its main thread; a server's engine thread asks: its figures are its own
    t, sizes = _Thread(), []
    pool = t.pool(2, sizes)
    t.step(1.0, 0.5, 0.5)
    seen: list[int] = []
    worker = threading.Thread(
        target=lambda: seen.extend([pool.check(), t.step(0.2, 0.1, 0.1) or pool.check()])
    )
    worker.start()
    worker.join()
    assert seen == [2, 1] and sizes == [1]  # the first look there only takes its figures


def test_without_schedstat_the_pool_keeps_its_size_and_bad_settings_are_refused() -> None:
    ticks = iter(range(100))
    figures = iter([(0, 0), None, (10**9, 10**9), (2 * 10**9, 2 * 10**9), None])
    sizes: list[int] = []
    pool = AdaptiveThreads(
        2, clock=lambda: float(next(ticks)), read=lambda: next(figures), resize=sizes.append
    )
    assert pool.check() == 2 and sizes == []  # None: no figures to compare
    assert pool.check() == 2 and sizes == []  # figures again: taken as the start
    assert pool.check() == 1 and sizes == [1]  # half the runnable time waiting
    assert pool.check() == 1 and sizes == [1]  # None again: nothing decided
    never = AdaptiveThreads(2, clock=lambda: float(next(ticks)), read=lambda: None, resize=sizes.append)
    assert [never.check() for _ in range(3)] == [2, 2, 2] and sizes == [1]
    for bad in ({"threads": 0}, {"threads": 2, "grow_after": 0}, {"threads": 2, "interval": 0.0}):
        with pytest.raises(ValueError, match="threads and grow_after must be >= 1 and interval > 0"):
            AdaptiveThreads(**bad, read=lambda: None, resize=sizes.append)


def _busy() -> None:
    while True:
        pass


@pytest.mark.skipif(schedstat() is None, reason="no run-queue accounting (/proc/thread-self/schedstat)")
def test_the_waiting_share_is_high_while_other_processes_take_every_core() -> None:
    load = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(2 * available_cores())]
    for p in load:
        p.start()
    try:
        start, (ran, waited) = time.monotonic(), schedstat()
        while time.monotonic() - start < 0.4:
            pass
        now_ran, now_waited = schedstat()
    finally:
        for p in load:
            p.terminate()
            p.join()
    share = (now_waited - waited) / (now_ran - ran + now_waited - waited)
    assert (
        share > CONTENDED_SHARE
    )  # two busy processes a core: this thread waits about two thirds of the time


def test_only_a_default_sized_pool_on_the_cpu_adapts() -> None:
    assert adaptive_threads(2, "cpu") is None and adaptive_threads(None, "cuda") is None
    pool = adaptive_threads(None, "cpu")
    assert pool is not None and pool.threads == pool.current == torch.get_num_threads()


def test_the_runner_asks_the_pool_before_every_forward() -> None:
    from kvdiet.engine.runner import CacheOptions, ModelRunner
    from kvdiet.model.build import load_model

    class Counting:
        calls = 0

        def check(self) -> int:
            Counting.calls += 1
            return 1

    model, _ = load_model("v4.1-micro", seed=0)
    with ModelRunner(model, CacheOptions(persistent_dir=None), threads=Counting()) as runner:
        session = runner.start(list(range(1, 40)))
        runner.prefill(session, chunk_size=16)  # three chunks
        runner.decode([session], [5])
        runner.decode([session], [6])
        runner.finish(session)
    assert Counting.calls == 3 + 2


@pytest.mark.slow
@pytest.mark.parametrize("model", ["v4.1-mini", "v4-mini"])
def test_a_prefill_and_decode_steps_have_the_same_bits_at_one_and_two_threads(model: str) -> None:
    """Why shrinking the pool from two threads to one changes no result: the same logits, bit for bit (on 3 or
    more threads torch's own ops split by the thread count: `AdaptiveThreads`' notes)."""
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


@pytest.mark.parametrize(("flags", "adapts"), [([], True), (["--threads", "1"], False)])
def test_generate_gives_its_runner_an_adaptive_pool_only_for_a_default_thread_count(
    monkeypatch, flags, adapts
):
    from kvdiet.engine import runner

    seen = []

    class Runner(runner.ModelRunner):
        def __init__(self, *args, threads=None, **kwargs):
            seen.append(threads)
            super().__init__(*args, threads=threads, **kwargs)

    monkeypatch.setattr(runner, "ModelRunner", Runner)  # generate imports it when it runs
    before = torch.get_num_threads()
    try:
        argv = ["generate", "--model", "v4.1-micro", "--prompt-ids", "1,2,3", "--max-tokens", "1"]
        assert main([*argv, "--persistent-dir", "none", "--json", *flags]) == 0
    finally:
        torch.set_num_threads(before)
    assert len(seen) == 1 and isinstance(seen[0], AdaptiveThreads) == adapts and (seen[0] is None) != adapts
