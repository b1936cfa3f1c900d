"""The study's forked runner turns cycle collection off while results arrive and restores it as it was, also
when a run fails."""

from __future__ import annotations

import gc
import os
from dataclasses import replace

import pytest

from kvdiet.sim import study
from kvdiet.sim.records import SimConfig
from kvdiet.sim.study import run_study
from kvdiet.sim.traces import Trace, TraceRequest

_TRACE = Trace([TraceRequest(0.0, 1100, 60, (1, 2), 1), TraceRequest(4.0, 1600, 1, (1, 2, 3), 2)], 512)
_RUNS = [SimConfig(), replace(SimConfig(), swa_pool_ttl_s=1.0)]


def _sees_gc(trace, config, send, blocks) -> None:
    send((True, gc.isenabled()))  # what the forked process inherited
    os._exit(0)


def _fails(trace, config, send, blocks) -> None:
    send((False, ValueError("failed")))
    os._exit(0)


@pytest.mark.parametrize("enabled", [True, False])
def test_collection_is_off_during_the_runs_and_restored(monkeypatch, enabled: bool) -> None:
    monkeypatch.setattr(study, "simulate_then_exit", _sees_gc)
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        done = run_study(_TRACE, _RUNS, jobs=2)
        assert done.runs == [False, False]  # off in every forked run
        assert gc.isenabled() is enabled
        monkeypatch.setattr(study, "simulate_then_exit", _fails)
        with pytest.raises(ValueError, match="failed"):
            run_study(_TRACE, _RUNS, jobs=2)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
