"""The SWA-policy study: several model-free runs on one trace (policies × models, and sweeps), and what they
establish.

A run is written ``POLICY@MODEL`` (``bounded-replay@deepseek-v4.1-flash``; the model defaults to the base
config's). `DEFAULT_RUNS` compares V4-Flash as DeepSeek deploys it (``boundary-snapshot``) with V4.1 under
every policy. A sweep varies one setting of one run (``swa-pool-ttl``, ``swa-pool-size``, ``persistent-ttl``,
``persistent-size``, ``device-size``); the SWA-pool TTL sweep gets an extra unbounded point, the reference
for "how much of what a pool could catch does this TTL catch". Runs are independent: each goes to a process
of its own forked from the study's, ``jobs`` at a time.

`findings` turns the results into the study's numbers: the peak persistent bytes of V4.1 (bounded replay) over
V4-Flash (boundary snapshots) and the window share of V4's, and the shortest swept TTL at which the SWA pool
restores at least `CATCH_TARGET` of what an unbounded pool restores.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import wait
from typing import NoReturn

from kvdiet.cache.plan import WindowSource
from kvdiet.cache.policies import parse_policy
from kvdiet.sim.model_free import request_blocks, simulate, simulate_then_exit
from kvdiet.sim.reblock import engine_block_size, reblock
from kvdiet.sim.records import SimConfig, SimResult
from kvdiet.sim.traces import Trace
from kvdiet.units import is_unbounded, parse_bytes, parse_duration

__all__ = [
    "CATCH_TARGET",
    "DEFAULT_RUNS",
    "DEFAULT_TTL_SWEEP",
    "SWEEP_AXES",
    "Study",
    "findings",
    "parse_run",
    "parse_sweep",
    "run_study",
]

_PR_SET_PDEATHSIG = 1  # prctl's option: the signal a process gets when its parent dies (linux/prctl.h)

DEFAULT_RUNS = (
    "boundary-snapshot@deepseek-v4-flash",
    "full-store@deepseek-v4-flash",
    "full-store@deepseek-v4.1-flash",
    "bounded-replay@deepseek-v4.1-flash",
    "checkpoint:4096@deepseek-v4.1-flash",
    "checkpoint:16384@deepseek-v4.1-flash",
    "exact-recompute@deepseek-v4.1-flash",
)
DEFAULT_TTL_SWEEP = "swa-pool-ttl=30s,1m,2m,5m,10m,30m"
DEFAULT_SUPERSEDE_SWEEP = "swa-pool-supersede=on"
"""The sweep run again with each session's newer pool snapshot replacing its older ones."""
CATCH_TARGET = 0.9
"""The share of an unbounded pool's restores a TTL must reach to "catch most boundary hits"."""


def _switch(text: str) -> float:
    """``on`` → 1, ``off`` → 0. Raises ValueError otherwise."""
    if text not in ("on", "off"):
        raise ValueError(f"expected on or off, got {text!r}")
    return float(text == "on")


SWEEP_AXES: dict[str, tuple[str, Callable[[str], float]]] = {
    "swa-pool-ttl": ("swa_pool_ttl_s", parse_duration),
    "swa-pool-size": ("swa_pool_bytes", parse_bytes),
    "persistent-ttl": ("persistent_ttl_s", parse_duration),
    "persistent-size": ("persistent_bytes", parse_bytes),
    "device-size": ("device_bytes", parse_bytes),
    "swa-pool-supersede": ("swa_pool_supersede", _switch),
    "global-pool-size": ("global_pool_bytes", parse_bytes),
    "global-pool-ttl": ("global_pool_ttl_s", parse_duration),
}
POSITIVE_SIZE_AXES = ("swa-pool-size", "persistent-size", "device-size")
"""Sweep axes whose sizes must be > 0 (``global-pool-size`` takes 0: no global pool)."""
UNBOUNDED_TTL_S = 1e12
UNBOUNDED_AXES = {"swa-pool-ttl": UNBOUNDED_TTL_S, "persistent-size": math.inf}
"""The sweep axes whose value may be ``unbounded`` (any case), as the point it stands for: the SWA-pool TTL
sweep's own last point, and the persistent tier's default (no size)."""


def parse_run(text: str, base: SimConfig) -> SimConfig:
    """``POLICY[@MODEL]`` → ``base`` with that policy (and model); spaces around ``@`` are taken, so a run's
    label (``bounded-replay @ deepseek-v4.1-flash``, in --json and report.md) reads back as the run.

    Raises:
        ValueError: an unknown policy (`kvdiet.cache.policies.parse_policy`).
    """
    policy, _, model = text.partition("@")
    return replace(base, policy=parse_policy(policy.strip()), model=model.strip() or base.model)


@dataclass(frozen=True)
class Sweep:
    """One axis swept over values for one run."""

    axis: str
    values: tuple[float, ...]
    labels: tuple[str, ...]

    def configs(self, base: SimConfig) -> list[tuple[str, SimConfig]]:
        """``(label, config)`` per point: ``base`` with the axis set; the TTL axis ends with "unbounded"."""
        field_name, _ = SWEEP_AXES[self.axis]
        points = list(zip(self.values, self.labels, strict=True))
        if self.axis == "swa-pool-ttl":  # "unbounded" given or not, it is the last point, once
            points = [p for p in points if p[0] != UNBOUNDED_TTL_S] + [(UNBOUNDED_TTL_S, "unbounded")]

        def typed(v: float) -> float | int | bool | None:
            if field_name.endswith("bytes"):
                return None if v == math.inf else int(v)  # persistent-size=unbounded: no size (the default)
            return bool(v) if field_name == "swa_pool_supersede" else v

        return [(label, replace(base, **{field_name: typed(v)})) for v, label in points]


def parse_sweep(text: str) -> Sweep:
    """``AXIS=V1,V2,...`` (durations like ``30s``/``5m``/``72h``, sizes like ``32GB``; ``unbounded`` on the
    `UNBOUNDED_AXES`).

    Raises:
        ValueError: unknown axis, no values, a value that does not parse (``unbounded`` on another axis named as
            needing a bound), a size of 0 where the axis needs
            one (`POSITIVE_SIZE_AXES`), or one value given twice (``5m,300s``).
    """
    axis, sep, items = text.partition("=")
    axis = axis.strip()
    if axis not in SWEEP_AXES or not sep:
        raise ValueError(
            f"--sweep {text!r}: expected AXIS=V1,V2,... with AXIS one of {', '.join(SWEEP_AXES)}"
        )
    labels = tuple(v.strip() for v in items.split(",") if v.strip())
    if not labels:
        raise ValueError(f"--sweep {text!r}: no values")
    _, parse = SWEEP_AXES[axis]
    values = tuple(
        UNBOUNDED_AXES[axis] if axis in UNBOUNDED_AXES and is_unbounded(v) else float(parse(v))
        for v in labels
    )
    for i, (label, value) in enumerate(zip(labels, values, strict=True)):
        if axis in POSITIVE_SIZE_AXES and value <= 0:
            raise ValueError(f"--sweep {text!r}: {axis} must be > 0 bytes, got {label!r}")
        if value in values[:i]:
            raise ValueError(f"--sweep {text!r}: {label!r} is {labels[values.index(value)]!r} again")
    return Sweep(axis, values, labels)


@dataclass
class Study:
    """The runs of a study: ``runs`` in order, and per sweep axis ``(label, result)`` pairs."""

    runs: list[SimResult]
    sweeps: dict[str, list[tuple[str, SimResult]]]


def _run_forked(
    inputs: dict[SimConfig, tuple[Trace, list[tuple[int, ...]]]],
    configs: Sequence[SimConfig],
    jobs: int,
    finished: Callable[[SimConfig, SimResult], None],
) -> None:
    """Simulate each config in a process of its own forked from this one, ``jobs`` at a time, in order;
    ``finished(config, result)`` as each ends. A forked process inherits its config's trace and blocks
    (``inputs``: the trace at the config's block size and its `request_blocks`; nothing pickled: a large
    agentic trace takes seconds to unpickle), sends its result back and exits without freeing its run
    (`simulate_then_exit`). The first failure stops the others and is raised here (RuntimeError when a
    process died without a word). Garbage collection is off meanwhile: results arrive as many small acyclic
    objects, which cycle collection would rescan for nothing."""
    context = multiprocessing.get_context("fork")
    todo, running = list(reversed(configs)), {}
    collecting = gc.isenabled()
    gc.disable()
    try:
        while todo or running:
            while todo and len(running) < jobs:
                config = todo.pop()
                receive, send = context.Pipe(duplex=False)
                args = (os.getpid(), inputs[config][0], config, send.send, inputs[config][1])
                proc = context.Process(target=_worker, args=args, daemon=True)
                proc.start()
                send.close()  # this end is the child's: its exit closes the pipe
                running[receive] = (config, proc)
            for receive in wait(list(running)):
                config, proc = running.pop(receive)
                try:
                    ok, value = receive.recv()
                except EOFError:
                    ok, value = False, None
                receive.close()
                proc.join()
                if not ok:
                    if isinstance(value, Exception):
                        raise value
                    raise RuntimeError(f"the simulation of {config.label} died (exit code {proc.exitcode})")
                finished(config, value)
    finally:
        for receive, (_, proc) in running.items():
            proc.kill()
            proc.join()
            receive.close()
        if collecting:
            gc.enable()


def _worker(parent: int, *args: object) -> NoReturn:
    """`simulate_then_exit` (``args``) in a forked worker that dies with the study's process ``parent``: a study
    killed (SIGTERM, SIGKILL: no ``finally`` of its own runs) left its workers blocked for ever on a pipe whose
    other end a sibling worker holds. On Linux the kernel sends the worker SIGKILL when its parent dies
    (``prctl(PR_SET_PDEATHSIG)``); a parent already gone by then ends it at once."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)
    simulate_then_exit(*args)


def run_study(
    trace: Trace,
    runs: Sequence[SimConfig],
    sweeps: Sequence[tuple[Sweep, SimConfig]] = (),
    *,
    jobs: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> Study:
    """Simulate every run and every sweep point (`simulate`), ``jobs`` at a time (default: CPU count).

    ``progress`` is called with the number of simulations finished (identical configs run once). Every
    config is checked first, so a bad one raises ValueError before any work. Each model runs at the block size
    its engine runs at (`kvdiet.sim.reblock`): the trace is re-blocked once per block size.
    """
    models = {cfg.model: cfg.check(trace.block_size) for cfg in [*runs, *(base for _, base in sweeps)]}
    todo: list[SimConfig] = list(runs)
    points: list[tuple[str, str]] = []
    for sweep, base in sweeps:
        for label, cfg in sweep.configs(base):
            todo.append(cfg)
            points.append((sweep.axis, label))
    unique = list(dict.fromkeys(todo))  # a sweep point equal to a run is simulated once
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(unique)))
    done: dict[SimConfig, SimResult] = {}

    def finished(cfg: SimConfig, result: SimResult) -> None:
        done[cfg] = result
        if progress is not None:
            progress(len(done))

    at: dict[int, tuple[Trace, list[tuple[int, ...]]]] = {}  # per block size, once
    for cfg in models.values():
        if (bs := engine_block_size(cfg, trace.block_size)) not in at:
            at[bs] = (t := reblock(trace, bs)), request_blocks(t)
    inputs = {cfg: at[engine_block_size(models[cfg.model], trace.block_size)] for cfg in unique}
    if jobs > 1 and "fork" in multiprocessing.get_all_start_methods():
        _run_forked(inputs, unique, jobs, finished)
    else:  # one job, or a platform that cannot fork: one run after another, here
        for cfg in unique:
            finished(cfg, simulate(inputs[cfg][0], cfg, blocks=inputs[cfg][1]))
    results = [done[cfg] for cfg in todo]
    out = Study(results[: len(runs)], {})
    for (axis, label), res in zip(points, results[len(runs) :], strict=True):
        out.sweeps.setdefault(axis, []).append((label, res))
    return out


def _find(runs: Sequence[SimResult], policy: str, model: str) -> SimResult | None:
    return next((r for r in runs if str(r.config.policy) == policy and r.config.model == model), None)


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def findings(study: Study) -> dict[str, object]:
    """The study's headline numbers (None where the runs they need are missing).

    - ``persistent_ratio_v41_over_v4``: the persistent tier's peak bytes, V4.1 ``bounded-replay`` over
      V4-Flash ``boundary-snapshot`` (the seeds' "about 1/8"); the same ratio of bytes written and of
      byte-hours beside it (``…_written``, ``…_byte_hours``). The peak is the headline
      (``persistent_ratio_basis``): bytes still resident when the trace ends depend on how much of the TTL
      the trace's tail covers, so one long session decides them.
    - ``v4_window_share``: the share of V4's persistent bytes that are window snapshots at its peak (seeds:
      "about half"); ``v4_window_share_written`` of the bytes written. ``global_kv_ratio_v41_over_v4``: the
      global KV bytes written, V4.1 over V4 (None where V4 wrote none: a trace of prompts under its block).
    - ``ttl_for_catch``: the shortest swept SWA-pool TTL whose pool restores reach `CATCH_TARGET` of the
      unbounded pool's, with each TTL's share; ``snapshot_age_*``: how old the snapshots an unbounded pool
      restores are (seconds) — the TTL a pool needs is read off these.
    """
    out: dict[str, object] = {}
    v41 = _find(study.runs, "bounded-replay", "deepseek-v4.1-flash")
    v4 = _find(study.runs, "boundary-snapshot", "deepseek-v4-flash")
    if v41 is not None and v4 is not None:
        a, b = v41.summary, v4.summary
        out["persistent_ratio_basis"] = "peak bytes"
        out["persistent_bytes_v41"] = a["persistent_bytes_peak"]
        out["persistent_bytes_v4"] = b["persistent_bytes_peak"]
        out["persistent_ratio_v41_over_v4"] = _ratio(a["persistent_bytes_peak"], b["persistent_bytes_peak"])
        out["persistent_ratio_written"] = _ratio(a["persistent_bytes_written"], b["persistent_bytes_written"])
        out["persistent_ratio_byte_hours"] = _ratio(a["persistent_byte_hours"], b["persistent_byte_hours"])
        # a share of nothing is no share (None, as the ratios beside it), not 0
        out["v4_window_share"] = b["persistent_window_share_at_peak"] if b["persistent_bytes_peak"] else None
        out["v4_window_share_written"] = _ratio(
            b.get("persistent_window_bytes_written", 0), b["persistent_bytes_written"]
        )
        out["global_kv_ratio_v41_over_v4"] = _ratio(
            a.get("persistent_kv_bytes_written", 0), b.get("persistent_kv_bytes_written", 0)
        )
    ttl = study.sweeps.get("swa-pool-ttl")
    if ttl:
        unbounded = ttl[-1][1]
        ref = unbounded.summary["window_sources"][WindowSource.SWA_POOL]
        shares = {
            label: (r.summary["window_sources"][WindowSource.SWA_POOL] / ref if ref else 0.0)
            for label, r in ttl[:-1]
        }
        out["ttl_catch_share"] = {k: round(v, 4) for k, v in shares.items()}
        out["ttl_for_catch"] = next((k for k, v in shares.items() if v >= CATCH_TARGET), None)
        out["catch_target"] = CATCH_TARGET
        ages = sorted(unbounded.snapshot_ages_s)
        for q in (0.5, 0.9, 0.99):
            key = f"snapshot_age_p{round(q * 100)}_s"
            out[key] = round(ages[min(len(ages) - 1, math.floor(q * len(ages)))], 3) if ages else None
        out["unbounded_pool_restores"] = ref
        out["boundary_hits"] = unbounded.summary["boundary_hits"]
    return out
