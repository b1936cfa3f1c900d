"""The study's figures, held to those recorded from the simulator before its speed work (commit 5ee9bbd, then
re-recorded once when snapshots began to be counted at the bytes the engine writes — `CacheSpec.snapshot_bytes`,
tested against the writer in tests/test_spec_snapshot.py): the default runs and sweeps, plus capacity sweeps,
on a generated agentic-like trace — every number of every run (summary, time series, per-request provenance,
snapshot ages) and the findings, as one digest. Re-recorded once more when each model began to run at its
engine's block size (`kvdiet.sim.reblock`: V4-Flash at 128 tokens on this 64-token trace): the V4.1 runs'
figures were unchanged but for the summary's new ``block_size``, only V4-Flash's two runs and the findings
of them moved (V4.1 / V4 persistent peak 0.0898 → 0.1207)."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict

from kvdiet.cache.plan import Provenance
from kvdiet.sim.records import SimConfig
from kvdiet.sim.study import (
    DEFAULT_RUNS,
    DEFAULT_SUPERSEDE_SWEEP,
    DEFAULT_TTL_SWEEP,
    findings,
    parse_run,
    parse_sweep,
    run_study,
)
from kvdiet.sim.traces import Trace, TraceRequest

RECORDED = "55c1111b439ba5712d672fc1d14ea31fbecdf26ef5ea7ae3da9592f9f8483418"
"""sha256 of `_figures` as the simulator computed them at 5ee9bbd, with snapshots sized as the engine writes
them and each model at its engine's block size (speed work keeps this digest)."""


def _trace(requests: int = 360, seed: int = 7) -> Trace:
    """Sessions resending a growing context (64-token blocks, one id per full block) every Exp(6 s), some
    forking a sub-agent off their first blocks; sessions start Exp(40 s) apart."""
    rng, fresh, out, start = random.Random(seed), iter(range(1, 1 << 40)), [], 0.0
    while len(out) < requests:
        start += rng.expovariate(1 / 40)
        t, tokens, ids, name = start, rng.randint(2_000, 12_000), [], f"s{len(out)}"
        for _ in range(rng.randint(3, 30)):
            ids += [next(fresh) for _ in range(tokens // 64 - len(ids))]
            out.append(
                TraceRequest(t, tokens, rng.randint(1, 600), tuple(ids), len(out) + 1, name, "main", "agent")
            )
            if rng.random() < 0.15:
                sub, st = ids[: rng.randint(2, 20)], t + rng.expovariate(1 / 3)
                sub_tokens = len(sub) * 64 + rng.randint(0, 3_000)
                sub += [next(fresh) for _ in range(sub_tokens // 64 - len(sub))]
                out.append(
                    TraceRequest(
                        st, sub_tokens, rng.randint(1, 300), tuple(sub), len(out) + 1, name, "sub", "subagent"
                    )
                )
            t += rng.expovariate(1 / 6)
            tokens += rng.randint(100, 2_500)
    out.sort(key=lambda r: r.arrival_s)
    return Trace(out[:requests], 64)


def _recorded(p: Provenance) -> dict[str, object]:
    """A request's provenance as recorded at 5ee9bbd: without ``global_pool_tokens`` (a field added since, for
    the shared global-KV DRAM tier, which these runs do not have: always 0 here)."""
    d = asdict(p)
    assert d.pop("global_pool_tokens") == 0
    return d


def _figures() -> str:
    base = SimConfig(device_bytes=150 * 10**6)  # V4-Flash holds 333 blocks of 128 tokens, V4.1 2,633 of 64
    sweeps = [
        (parse_sweep(text), parse_run("bounded-replay", base))
        for text in (
            DEFAULT_TTL_SWEEP,
            DEFAULT_SUPERSEDE_SWEEP,
            "device-size=30MB,60MB",
            "persistent-size=100MB,400MB",
            "persistent-ttl=2m,20m",
            "swa-pool-size=20MB,100MB",
        )
    ]
    study = run_study(_trace(), [parse_run(r, base) for r in DEFAULT_RUNS], sweeps, jobs=1)
    results = [*study.runs, *(r for points in study.sweeps.values() for _, r in points)]
    every = [(r.as_dict(), [_recorded(p) for p in r.requests], r.snapshot_ages_s) for r in results]
    return json.dumps([every, findings(study)], sort_keys=True, default=str)


def test_the_study_gives_the_recorded_figures() -> None:
    assert hashlib.sha256(_figures().encode()).hexdigest() == RECORDED
