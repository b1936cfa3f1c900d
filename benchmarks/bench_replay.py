"""Model-free replay speed on a real trace: requests per second per simulated run, and the whole study.

Default trace: the Mooncake conversation trace (12,031 requests, 1 h of Kimi traffic), expected at
``../shared/traces/mooncake/conversation_trace.jsonl`` (download it from github.com/kvcache-ai/Mooncake,
``FAST25-release/traces/``). Measured in one run:

- read: parsing the JSONL into requests;
- baseline: the infinite-cache pass (`kvdiet.sim.traces.infinite_cache_hit_ratio`), the least work any
  replay does: one set lookup per block, no tiers;
- each default run of the study alone (`kvdiet.sim.model_free.simulate`, one process): seconds and
  requests/s, and its cost over the baseline;
- the default study (7 runs + the 7-point SWA-pool TTL sweep: 13 distinct simulations) as ``kvdiet replay``
  runs it, with ``--jobs`` worker processes.

The simulation is deterministic (no seed needed): the same trace gives the same results. Prints a table,
then one JSON line.

    python benchmarks/bench_replay.py
    python benchmarks/bench_replay.py --trace ../shared/traces/mooncake/synthetic_trace.jsonl --jobs 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvdiet.sim.model_free import simulate
from kvdiet.sim.records import SimConfig
from kvdiet.sim.study import DEFAULT_RUNS, DEFAULT_TTL_SWEEP, parse_run, parse_sweep, run_study
from kvdiet.sim.trace_stats import infinite_cache_hit_ratio
from kvdiet.sim.traces import read_trace

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--trace", default=str(DEFAULT_TRACE), help="trace file (default: Mooncake conversation)"
    )
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count(), help="workers for the study (default: CPUs)"
    )
    args = parser.parse_args()
    if not Path(args.trace).is_file():
        sys.exit(
            f"bench_replay: {args.trace} not found; get it from github.com/kvcache-ai/Mooncake "
            "(FAST25-release/traces/) and pass --trace"
        )

    t0 = time.perf_counter()
    trace = read_trace(args.trace)
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    infinite_cache_hit_ratio(trace)
    base_s = time.perf_counter() - t0
    n = len(trace)

    base = SimConfig()
    rows = []
    for name in DEFAULT_RUNS:
        cfg = parse_run(name, base)
        t0 = time.perf_counter()
        simulate(trace, cfg)
        s = time.perf_counter() - t0
        rows.append(
            {
                "run": cfg.label,
                "seconds": round(s, 3),
                "requests_per_s": round(n / s),
                "over_baseline": round(s / base_s, 1),
            }
        )

    runs = [parse_run(name, base) for name in DEFAULT_RUNS]
    sweep = parse_sweep(DEFAULT_TTL_SWEEP)
    t0 = time.perf_counter()
    study = run_study(trace, runs, [(sweep, parse_run("bounded-replay", base))], jobs=args.jobs)
    study_s = time.perf_counter() - t0
    results = [*study.runs, *(r for points in study.sweeps.values() for _, r in points)]
    simulations = len({id(r) for r in results})  # a sweep point equal to a run is simulated once

    table = Table(title=f"model-free replay of {Path(args.trace).name} ({n:,} requests)")
    for col in ("step", "seconds", "requests/s", "× baseline"):
        table.add_column(col, justify="left" if col == "step" else "right")
    table.add_row("read the trace", f"{read_s:.3f}", f"{n / read_s:,.0f}", "")
    table.add_row("baseline: infinite-cache pass", f"{base_s:.3f}", f"{n / base_s:,.0f}", "1.0")
    for r in rows:
        table.add_row(
            r["run"], f"{r['seconds']:.3f}", f"{r['requests_per_s']:,}", f"{r['over_baseline']:.1f}"
        )
    table.add_row(
        f"study: {simulations} simulations, {args.jobs} jobs",
        f"{study_s:.3f}",
        f"{n * simulations / study_s:,.0f}",
        "",
    )
    Console().print(table)
    print(
        json.dumps(
            {
                "bench": "replay",
                "trace": Path(args.trace).name,
                "requests": n,
                "read_s": round(read_s, 3),
                "baseline_s": round(base_s, 4),
                "runs": rows,
                "mean_requests_per_s": round(n * len(rows) / sum(r["seconds"] for r in rows)),
                "study_simulations": simulations,
                "study_jobs": args.jobs,
                "study_s": round(study_s, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
