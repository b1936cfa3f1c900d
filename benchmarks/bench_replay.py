"""Model-free replay speed: requests and prompt blocks per second per simulated run, and the whole default study.

Two traces, measured in one run:

- ``mooncake``: the Mooncake conversation trace (12,031 requests, 1 h of Kimi traffic, 512-token blocks),
  expected at ``../shared/traces/mooncake/conversation_trace.jsonl`` (github.com/kvcache-ai/Mooncake,
  ``FAST25-release/traces/``); skipped when absent;
- ``agentic``: a deterministic generator of coding-agent traffic (`agentic_trace`: 13K requests, prompts of
  117K tokens on average, as real sessions (~115K), the whole growing context resent every few seconds,
  sub-agents forking off a session's prefix, 64-token blocks, one id per full block).

For each: the read (or generation), the infinite-cache pass (`infinite_cache_hit_ratio`, the least work any
replay does), each default run of the study alone (`kvdiet.sim.model_free.simulate`, one process) with its
requests/s and prompt blocks/s, and the default study (the default runs and sweeps, as ``kvdiet replay`` runs
it) with ``--jobs`` worker processes. Deterministic (fixed seed). Prints a table per trace, then one JSON line.
Runs on the compiled simulator core as ``kvdiet replay`` does (`kvdiet.sim.simcore`: built first when missing,
not timed; ``"core": "mypyc"`` in the JSON); ``--simcore off`` measures the Python modules (the baseline).

    python benchmarks/bench_replay.py
    python benchmarks/bench_replay.py --jobs 1 --agentic-requests 4000
    python benchmarks/bench_replay.py --simcore off       # the same on the Python modules
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvdiet.cli import ArgumentParser
from kvdiet.sim.model_free import simulate
from kvdiet.sim.records import SimConfig
from kvdiet.sim.simcore import active, relaunch
from kvdiet.sim.study import (
    DEFAULT_RUNS,
    DEFAULT_SUPERSEDE_SWEEP,
    DEFAULT_TTL_SWEEP,
    parse_run,
    parse_sweep,
    run_study,
)
from kvdiet.sim.trace_stats import infinite_cache_hit_ratio
from kvdiet.sim.traces import Trace, TraceRequest, read_trace

MOONCAKE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
SEED = 0
BLOCK = 64


def agentic_trace(requests: int = 13_000, seed: int = SEED) -> Trace:
    """Coding-agent sessions: each starts from a 60K–120K-token context, adds 0.2K–3K tokens per turn, resends
    the whole context every Exp(5 s) until it passes ~250K tokens (prompts average 117K tokens); 1 turn in 12
    forks a sub-agent that keeps the session's first blocks and runs 3–10 turns of its own. Sessions start
    Exp(30 s) apart. One id per full 64-token block, chained (an id names its whole prefix)."""
    rng = random.Random(seed)
    next_id = iter(range(1 << 62))
    out: list[TraceRequest] = []
    start, session = 0.0, 0
    while len(out) < requests:
        start += rng.expovariate(1 / 30)
        ids: list[int] = []
        tokens, t, name = rng.randint(60_000, 120_000), start, f"s{session}"
        while tokens < 250_000 and len(out) < requests:
            ids += [next(next_id) for _ in range(tokens // BLOCK - len(ids))]
            out.append(
                TraceRequest(t, tokens, rng.randint(50, 800), tuple(ids), len(out) + 1, name, "main", "agent")
            )
            if rng.random() < 1 / 12:  # a sub-agent: the session's first blocks, then its own context
                sub, sub_tokens, st = ids[: rng.randint(8, 40)], rng.randint(4_000, 20_000), t
                for _ in range(rng.randint(3, 10)):
                    st += rng.expovariate(1 / 4)
                    sub_tokens += rng.randint(300, 4_000)
                    sub += [next(next_id) for _ in range(sub_tokens // BLOCK - len(sub))]
                    out.append(
                        TraceRequest(
                            st,
                            sub_tokens,
                            rng.randint(50, 800),
                            tuple(sub),
                            len(out) + 1,
                            name,
                            "sub",
                            "subagent",
                        )
                    )
            t += rng.expovariate(1 / 5)
            tokens += rng.randint(200, 3_000)
        session += 1
    out.sort(key=lambda r: r.arrival_s)
    t0 = out[0].arrival_s
    return Trace([replace(r, arrival_s=r.arrival_s - t0) for r in out[:requests]], BLOCK)


def measure(name: str, trace: Trace, load_s: float, jobs: int) -> dict[str, object]:
    n = len(trace.requests)
    blocks = sum(r.input_tokens // trace.block_size for r in trace.requests)
    t0 = time.perf_counter()
    infinite_cache_hit_ratio(trace)
    base_s = time.perf_counter() - t0
    base = SimConfig()
    rows = []
    for run in DEFAULT_RUNS:
        cfg = parse_run(run, base)
        t0 = time.perf_counter()
        simulate(trace, cfg)
        s = time.perf_counter() - t0
        rows.append(
            {
                "run": cfg.label,
                "seconds": round(s, 3),
                "requests_per_s": round(n / s),
                "blocks_per_s": round(blocks / s),
            }
        )
    sweeps = [
        (parse_sweep(t), parse_run("bounded-replay", base))
        for t in (DEFAULT_TTL_SWEEP, DEFAULT_SUPERSEDE_SWEEP)
    ]
    t0 = time.perf_counter()
    study = run_study(trace, [parse_run(r, base) for r in DEFAULT_RUNS], sweeps, jobs=jobs)
    study_s = time.perf_counter() - t0
    sims = len({id(r) for r in [*study.runs, *(r for p in study.sweeps.values() for _, r in p)]})

    table = Table(
        title=f"model-free replay, {name}: {n:,} requests, {blocks:,} prompt blocks of {trace.block_size}"
    )
    for col in ("step", "seconds", "requests/s", "blocks/s"):
        table.add_column(col, justify="left" if col == "step" else "right")
    table.add_row("read / generate", f"{load_s:.3f}", f"{n / load_s:,.0f}", "")
    table.add_row("infinite-cache pass", f"{base_s:.3f}", f"{n / base_s:,.0f}", f"{blocks / base_s:,.0f}")
    for r in rows:
        table.add_row(r["run"], f"{r['seconds']:.3f}", f"{r['requests_per_s']:,}", f"{r['blocks_per_s']:,}")
    table.add_row(f"default study: {sims} simulations, {jobs} jobs", f"{study_s:.3f}", "", "")
    Console().print(table)
    return {
        "trace": name,
        "requests": n,
        "prompt_blocks": blocks,
        "block_size": trace.block_size,
        "load_s": round(load_s, 3),
        "baseline_s": round(base_s, 4),
        "runs": rows,
        "mean_requests_per_s": round(n * len(rows) / sum(r["seconds"] for r in rows)),
        "study_simulations": sims,
        "study_jobs": jobs,
        "study_s": round(study_s, 3),
    }


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--trace", default=str(MOONCAKE), help="Mooncake-format trace (default: conversation)"
    )
    parser.add_argument(
        "--agentic-requests", type=int, default=13_000, help="requests of the generated trace"
    )
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count(), help="workers for the study (default: CPUs)"
    )
    parser.add_argument(
        "--simcore",
        choices=("auto", "off"),
        default="auto",
        help="run on the compiled simulator core (kvdiet.sim.simcore; auto: built first when missing) or on "
        "the Python sources (off)",
    )
    args = parser.parse_args()
    if args.simcore == "auto":  # re-executes this script with the compiled modules (built first if needed)
        command = [str(Path(__file__).resolve()), *sys.argv[1:]]
        relaunch(command, build_first=True, log=lambda line: print(f"bench_replay: {line}", file=sys.stderr))
    results = []
    if Path(args.trace).is_file():
        t0 = time.perf_counter()
        trace = read_trace(args.trace)
        results.append(measure(Path(args.trace).name, trace, time.perf_counter() - t0, args.jobs))
    else:
        Console(stderr=True).print(f"bench_replay: {args.trace} not found; measuring the agentic trace only")
    t0 = time.perf_counter()
    trace = agentic_trace(args.agentic_requests)
    results.append(measure("agentic (generated)", trace, time.perf_counter() - t0, args.jobs))
    core = "mypyc" if active() else "python"
    Console().print(f"simulator core: {core}")
    print(json.dumps({"bench": "replay", "seed": SEED, "core": core, "results": results}))


if __name__ == "__main__":
    main()
