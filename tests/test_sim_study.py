"""The study's runner: each simulation in a forked process (results, failures, a process that dies), the blocks
every run of a trace shares, and the per-request records sent back."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kvdiet.cache.plan import Provenance, WindowSource
from kvdiet.cache.policies import parse_policy
from kvdiet.sim import study
from kvdiet.sim.model_free import request_blocks, simulate
from kvdiet.sim.records import SimConfig
from kvdiet.sim.study import parse_sweep, run_study
from kvdiet.sim.traces import Trace, TraceRequest


def _trace() -> Trace:
    reqs = [
        TraceRequest(0.0, 1100, 600, (1, 2, 3), 1),  # 1,699 tokens cached: 2 named blocks, then −1, −2
        TraceRequest(5.0, 1600, 1, (1, 2, 4, 5), 2),  # 1,600: 3 named blocks, the straddling one −3
        TraceRequest(9.0, 512, 1, None, 3),  # no ids: its one block is its own, −4
        TraceRequest(20.0, 1100, 30, (1, 2, 3), 4),  # 1,129: 2 named, then −5
    ]
    return Trace(reqs, 512)


def test_request_blocks_are_the_named_ids_then_ids_of_their_own() -> None:
    assert request_blocks(_trace()) == [(1, 2, -1, -2), (1, 2, 4, -3), (-4,), (1, 2, -5)]


def test_forked_runs_give_what_runs_here_give() -> None:
    trace = _trace()
    runs = [SimConfig(), replace(SimConfig(), policy=parse_policy("full-store"))]
    sweeps = [(parse_sweep("swa-pool-ttl=3s"), runs[0])]
    done: list[int] = []
    forked = run_study(trace, runs, sweeps, jobs=2, progress=done.append)
    here = run_study(trace, runs, sweeps, jobs=1)
    assert done == [1, 2, 3, 4]  # the 3 s point, the unbounded one, two runs
    results = [[*s.runs, *(r for _, r in s.sweeps["swa-pool-ttl"])] for s in (forked, here)]
    for a, b in zip(*results, strict=True):
        assert (a.as_dict(), a.requests, a.snapshot_ages_s) == (b.as_dict(), b.requests, b.snapshot_ages_s)
    assert forked.runs[0].as_dict() == simulate(trace, SimConfig()).as_dict()
    assert [r.window_source for r in forked.runs[0].requests] == ["none", "swa-pool", "none", "swa-pool"]


def _fails(trace, config, send, blocks) -> None:
    send((False, ValueError(f"no run of {config.label}")))
    os._exit(0)


def _dies(trace, config, send, blocks) -> None:
    os._exit(3)


def test_a_failed_run_is_raised_here(monkeypatch) -> None:
    monkeypatch.setattr(study, "simulate_then_exit", _fails)
    with pytest.raises(ValueError, match="no run of bounded-replay"):
        run_study(_trace(), [SimConfig(), replace(SimConfig(), swa_pool_ttl_s=1.0)], jobs=2)


def test_a_process_that_dies_is_named(monkeypatch) -> None:
    monkeypatch.setattr(study, "simulate_then_exit", _dies)
    with pytest.raises(RuntimeError, match=r"simulation of bounded-replay .* died \(exit code 3\)"):
        run_study(_trace(), [SimConfig(), replace(SimConfig(), swa_pool_ttl_s=1.0)], jobs=2)


def _hangs(trace, config, send, blocks) -> None:
    Path(os.environ["KVDIET_TEST_PIDS"], str(os.getpid())).touch()
    time.sleep(300)  # a run still going (or blocked on its pipe) when the study is killed
    os._exit(0)


def _study_then_wait(folder: str) -> None:
    os.environ["KVDIET_TEST_PIDS"] = folder
    study.simulate_then_exit = _hangs  # this process is the test's fork: its own module, patched
    run_study(_trace(), [SimConfig(), replace(SimConfig(), swa_pool_ttl_s=1.0)], jobs=2)


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie nobody reaped counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_workers_die_with_a_study_that_is_killed(tmp_path: Path) -> None:
    """A study killed outright (SIGKILL: none of its own clean-up runs; SIGTERM did the same) left its workers
    blocked for ever (on a pipe whose other end a sibling held); they now die with it."""
    parent = multiprocessing.get_context("fork").Process(target=_study_then_wait, args=(str(tmp_path),))
    parent.start()
    deadline = time.monotonic() + 60
    while len(list(tmp_path.iterdir())) < 2:
        assert time.monotonic() < deadline and parent.is_alive(), "the workers did not start"
        time.sleep(0.05)
    workers = [int(p.name) for p in tmp_path.iterdir()]
    assert not any(_gone(pid) for pid in workers)
    os.kill(parent.pid, signal.SIGKILL)
    parent.join()
    deadline = time.monotonic() + 30
    while not all(_gone(pid) for pid in workers):
        assert time.monotonic() < deadline, f"workers {workers} outlived the study"
        time.sleep(0.05)


def test_provenance_pickles_field_for_field() -> None:
    p = Provenance(1100, 512, 0, 0, WindowSource.SWA_POOL, 128, 3, 588, False)
    back = pickle.loads(pickle.dumps(p))
    assert back == p and back.window_source is WindowSource.SWA_POOL and back.hit_tokens == 512
