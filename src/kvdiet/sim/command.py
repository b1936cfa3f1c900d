"""``kvdiet replay``: replay a request trace through the cache system and compare SWA policies.

Modes: ``model-free`` (default; `kvdiet.sim.study` runs of `kvdiet.sim.model_free`), ``engine`` (the real
engine on a capped, scaled slice: `kvdiet.sim.engine_mode`) and ``stats`` (the trace's statistics only).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvdiet.engine.progress import StepProgress
from kvdiet.sim.replay_flags import plan_runs

__all__ = ["add_replay_parser", "run_replay"]

EPILOG = """\
examples:
  kvdiet replay ../shared/traces/mooncake/conversation_trace.jsonl                 # policy table
  kvdiet replay ../shared/traces/mooncake/conversation_trace.jsonl --report out/   # + markdown and plots
  kvdiet replay TRACE --runs bounded-replay,boundary-snapshot@deepseek-v4-flash --sweep none --json
  kvdiet replay TRACE --sweep device-size=8GB,32GB,128GB --sweep swa-pool-ttl=1m,5m,30m
  kvdiet replay TRACE --mode engine --max-requests 6                              # the real engine, v4.1-mini
  kvdiet replay TRACE --mode stats                                                # trace statistics only

A run is POLICY[@MODEL]: bounded-replay, boundary-snapshot, full-store, checkpoint:K, exact-recompute;
MODEL defaults to --model. Sweep axes: swa-pool-ttl, swa-pool-size, swa-pool-supersede, persistent-ttl, persistent-size,
global-pool-size, global-pool-ttl, device-size (each sweeps the run of --sweep-run; --global-pool-size > 0 adds the
shared global-KV DRAM tier between the device pool and the persistent tier).
Traces: Mooncake JSONL (github.com/kvcache-ai/Mooncake,
FAST25-release/traces/), kvdiet's generic JSONL, Azure LLM inference CSV (github.com/Azure/AzurePublicDataset),
agentic session files (a .json file or a folder of them: ../shared/traces/agentic-sample).
"""


def add_replay_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``replay`` sub-command to ``sub``."""
    from kvdiet.sim.study import DEFAULT_TTL_SWEEP

    rep = sub.add_parser(
        "replay",
        help="replay a request trace through the cache tiers and compare SWA policies (model-free or engine)",
        description="Read a Mooncake JSONL, generic JSONL or Azure CSV trace and replay it: model-free (the "
        "device pool, persistent tier and SWA pool simulated in trace time with the exact byte geometry of "
        "each config and a FLOPs cost model; seconds for 12,000 requests) or through the real engine on a "
        "scaled, capped slice (measured TTFT). Prints the trace statistics and one row per run; --report "
        "writes markdown and plots.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rep.add_argument("trace", help="trace file (.jsonl, .csv, .json) or a folder of session files")
    rep.add_argument(
        "--format",
        default="auto",
        choices=["auto", "mooncake", "jsonl", "azure", "agentic-sessions"],
        help="trace format (default auto: a folder or a .json file is agentic-sessions; .csv is Azure; a "
        ".jsonl with a kvdiet-trace header line is the generic JSONL, otherwise Mooncake)",
    )
    rep.add_argument(
        "--session-start",
        metavar="together|staggered:SECONDS|poisson:RATE",
        help="agentic-sessions only: where each session (files by name) starts, as sessions carry no "
        "absolute time. Default together: every session at 0 — no invented arrival process, and the most "
        "overlap, so the tiers' capacities are under the most pressure; staggered:S starts session i at "
        "i*S seconds (S 0 to 1e9); poisson:R draws exponential gaps at R sessions/s (1e-9 to 1e9) from a fixed seed",
    )
    rep.add_argument(
        "--strict",
        action="store_true",
        help="stop at the first malformed line or timestamp going backwards (default: skip the line; "
        "re-sort the requests with a warning)",
    )
    rep.add_argument(
        "--mode", default="model-free", choices=["model-free", "engine", "stats"], help="default model-free"
    )
    rep.add_argument("--json", action="store_true", help="print everything as one JSON object")
    rep.add_argument("--report", metavar="DIR", help="write DIR/report.md and plots (its parent must exist)")
    g = rep.add_argument_group("runs and sweeps")
    g.add_argument(
        "--runs",
        help="comma-separated POLICY[@MODEL] (model-free default: V4-Flash boundary-snapshot and full-store, "
        "V4.1 under every policy; engine mode: MODEL is the preset the engine loads, e.g. "
        "boundary-snapshot@v4-mini,bounded-replay@v4.1-mini; default bounded-replay on --engine-model)",
    )
    g.add_argument(
        "--sweep",
        action="append",
        help=f"AXIS=V1,V2,... (repeatable; 'none' for no sweep; default {DEFAULT_TTL_SWEEP})",
    )
    g.add_argument(
        "--sweep-run",
        help="the POLICY[@MODEL] a sweep varies (default bounded-replay)",
    )
    g.add_argument("--model", help="config of runs without @MODEL (default deepseek-v4.1-flash)")
    g.add_argument("--jobs", type=int, help="worker processes (default: CPU count)")
    g.add_argument(
        "--simcore",
        choices=("auto", "off"),
        help="model-free runs on the simulator's hot modules compiled by mypyc (auto: built on first use, "
        "~15 s, cached per source version; ~1.8x less CPU, the same figures) or on their Python sources "
        "(off; also KVDIET_SIMCORE=0)",
    )
    g.add_argument(
        "--progress-interval",
        type=float,
        metavar="SECONDS",
        help="progress goes to stderr: a bar on a terminal, else a line every SECONDS (default 10; 0 = after "
        "every run or request)",
    )
    t = rep.add_argument_group(
        "tiers and cost model",
        "model-free mode only, but --persistent-ttl and --swa-pool-* (engine mode too)",
    )
    t.add_argument("--device-size", help="device-pool budget for global KV (default 32GB)")
    t.add_argument(
        "--persistent-size",
        help="persistent-tier budget, LRU beyond it (default unbounded; 'unbounded' says so)",
    )
    t.add_argument("--persistent-ttl", help="persistent-tier TTL (default 72h)")
    t.add_argument("--swa-pool-size", help="SWA-pool budget (default 200GB: 10%% of 2 TB)")
    t.add_argument("--swa-pool-ttl", help="SWA-pool TTL (default 5m)")
    t.add_argument(
        "--swa-pool-supersede",
        action="store_true",
        default=None,
        help="a session's newer SWA-pool snapshot replaces its older ones (default: they stay until TTL/LRU)",
    )
    t.add_argument(
        "--global-pool-size",
        help="shared global-KV DRAM tier between the device pool and the persistent tier, LRU beyond it "
        "(default 0: none)",
    )
    t.add_argument("--global-pool-ttl", help="global-pool TTL (default 1h)")
    t.add_argument(
        "--gpu",
        type=str.lower,
        help="GPU of the compute cost model: h100, h200, b200 (any case; default h200)",
    )
    t.add_argument("--mfu", type=float, help="model FLOPs utilisation (default 0.5)")
    t.add_argument("--output-tok-s", type=float, help="decode speed per request, sets finish times (50)")
    e = rep.add_argument_group("engine mode", "refused in other modes, as are --threads and --device cuda")
    e.add_argument(
        "--engine-model",
        help="model the engine loads for runs without @MODEL (default v4.1-mini; v4-mini runs V4-Flash)",
    )
    e.add_argument(
        "--max-requests", type=int, help="requests from the trace's start (default 8; engine mode only)"
    )
    e.add_argument(
        "--engine-block-size",
        type=int,
        help="engine tokens per trace block, the same for every run (default 16; 128 when a run is V4-Flash)",
    )
    e.add_argument(
        "--time-scale",
        type=float,
        help="wall seconds per trace second; 0 = one request at a time, deterministic (default)",
    )
    e.add_argument("--kv-cache-memory", help="engine device pool (default 1GiB)")
    e.add_argument("--max-num-seqs", type=int, help="engine batch limit (default 4)")
    e.add_argument("--seed", type=int, help="weights and prompt synthesis seed (default 0)")
    return rep


def run_replay(args: argparse.Namespace, console: Console) -> None:
    """Run ``kvdiet replay`` with parsed ``args``.

    The report directory is created only once the runs have succeeded; ``--json`` prints strict JSON
    (a non-finite number becomes null).

    Raises:
        ValueError: a bad flag value, a trace line (strict) or timestamp going backwards (strict), a trace
            most of whose lines are malformed, before any simulation.
        OSError: the trace or the report directory.
    """
    from kvdiet.sim.agentic import session_reader
    from kvdiet.sim.trace_stats import trace_notes, trace_stats
    from kvdiet.sim.traces import read_trace

    sessions = session_reader(args.trace, format=args.format, start=args.session_start, strict=args.strict)
    jobs = plan_runs(args)  # flags checked before the trace is read
    if not Path(args.trace).exists():
        raise ValueError(f"{args.trace}: no such trace file or folder")
    if args.mode == "model-free" and args.simcore == "auto" and getattr(args, "own_process", False):
        from kvdiet.sim.simcore import relaunch

        command = ["-P", "-m", "kvdiet.cli", *args.argv]  # -P: the working directory shadows no module
        relaunch(command, build_first=True, log=lambda line: print(f"kvdiet replay: {line}", file=sys.stderr))
    trace = sessions() if sessions else read_trace(args.trace, format=args.format, strict=args.strict)
    for note in trace_notes(trace):
        print(f"kvdiet replay: {note}", file=sys.stderr)
    if not trace.requests:
        raise ValueError(f"{args.trace}: no requests")
    stats = trace_stats(trace)
    out: dict[str, object] = {"trace": stats}
    err = Console(stderr=True)
    study = facts = engine = None
    if args.mode == "model-free":
        study, facts = _model_free(trace, jobs, args, err)
        from kvdiet.sim.simcore import active

        out |= {"runs": [r.as_dict() for r in study.runs], "sweeps": _sweeps_json(study), "findings": facts}
        out["simulator_core"] = "mypyc" if active() else "python"  # which modules ran (the same figures)
    elif args.mode == "engine":
        engine = _engine(trace, jobs, args, err)
        out["engine"] = [e.summary() | {"ttft_s": [round(x, 4) for x in e.ttft_s]} for e in engine]
    if args.report:
        from kvdiet.sim.report import write_report

        try:
            path = write_report(
                args.report,
                trace_name=Path(args.trace).name,
                stats=stats,
                study=study,
                facts=facts,
                engine=engine,
                arrivals_s=[r.arrival_s for r in trace.requests],
                command="kvdiet replay " + " ".join(shlex.quote(a) for a in sys.argv[2:])
                if sys.argv[1:2] == ["replay"]
                else "",
            )
        except OSError as exc:  # the folder went away or filled up during the runs
            raise ValueError(f"--report {args.report}: {(exc.strerror or str(exc)).lower()}") from None
        out["report"] = str(path)
    if args.json:
        print(json.dumps(_finite(out), allow_nan=False))
        return
    _print(out, study, engine, console)


def _finite(value: object) -> object:
    """``value`` with every NaN or infinite float replaced by None (strict JSON has no such numbers)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _progress(err: Console, total: int, label: str, unit: str, interval_s: float) -> StepProgress:
    """A bar on a terminal, else a line every ``interval_s`` on stderr (a log, a pipe, CI)."""
    return StepProgress(
        total, stream=err.file, label=label, unit=unit, rate_unit=f"{unit}/s", interval_s=interval_s
    )


def _counter(bar: StepProgress) -> Callable[[int], None]:
    """A callback taking the count done so far (what the runners report) for ``bar``."""
    return lambda k: bar.advance(k - bar.done)


def _fit_period(cfg, trace_block_size: int):
    """A default run ``cfg`` (`SimConfig`) whose checkpoint period is not a multiple of the block size it runs at
    (a generic trace's blocks of 100 tokens: 4,096 is not) with the period rounded up to one, saying so on
    stderr; any other run as it is (a period the user gave is refused instead, naming a fitting one)."""
    import dataclasses

    from kvdiet.cache.policies import parse_policy
    from kvdiet.config import load_config
    from kvdiet.sim.reblock import engine_block_size

    k = cfg.policy.checkpoint_every
    bs = engine_block_size(load_config(cfg.model), trace_block_size)
    if k is None or k % bs == 0:
        return cfg
    fitted = dataclasses.replace(cfg, policy=parse_policy(f"checkpoint:{-(-k // bs) * bs}"))
    note = f"{cfg.label} runs as {fitted.label} (its period in whole {bs}-token blocks)"
    print(f"kvdiet replay: {note}", file=sys.stderr)
    return fitted


def _model_free(trace, plan, args, err: Console):
    from kvdiet.sim.reblock import engine_block_size, reblock_note
    from kvdiet.sim.study import findings, run_study
    from kvdiet.sim.trace_stats import past_context_notes

    runs, sweeps = plan
    if args.runs is None:  # the default runs fit their checkpoint periods to the trace's blocks
        runs = list(dict.fromkeys(_fit_period(cfg, trace.block_size) for cfg in runs))
    models = {}
    for cfg in [*runs, *(base for _, base in sweeps)]:  # before the progress bar: errors stay one clean line
        models[cfg.model] = cfg.check(trace.block_size)
    limits = {model: cfg.max_position_embeddings for model, cfg in models.items()}
    for note in past_context_notes(trace, limits):
        print(f"kvdiet replay: {note}", file=sys.stderr)
    for model, cfg in models.items():
        if (bs := engine_block_size(cfg, trace.block_size)) != trace.block_size:
            print(f"kvdiet replay: {reblock_note(model, bs, trace.block_size)}", file=sys.stderr)
    total = len(set(runs) | {cfg for s, base in sweeps for _, cfg in s.configs(base)})
    with _progress(err, total, f"replaying {len(trace):,} requests", "runs", args.progress_interval) as bar:
        study = run_study(trace, runs, sweeps, jobs=args.jobs, progress=_counter(bar))
    return study, findings(study)


def _engine(trace, configs, args, err: Console):
    from kvdiet.sim.engine_mode import run_engine_mode

    out = []
    for cfg in configs:
        n = min(cfg.max_requests, len(trace))
        with _progress(err, n, f"engine {cfg.cache.policy}", "requests", args.progress_interval) as bar:
            out.append(run_engine_mode(trace, cfg, progress=_counter(bar)))
    return out


def _sweeps_json(study) -> dict[str, list[dict[str, object]]]:
    return {
        axis: [{"value": label} | r.as_dict() for label, r in points] for axis, points in study.sweeps.items()
    }


def _print(out: dict, study, engine, console: Console) -> None:
    stats = out["trace"]
    for key, value in stats.items():
        if isinstance(value, dict):
            text = ", ".join(f"{k} {v:,}" for k, v in value.items())
        elif isinstance(value, bool | str):
            text = str(value).lower()
        else:
            text = f"{value:,}"
        console.print(f"{key:34s} {text}", markup=False, highlight=False, soft_wrap=True)
    if study is not None:
        from kvdiet.sim.report import comparison_rows

        pooled = ("global pool",) if any(r.config.has_global_pool for r in study.runs) else ()
        cols = (
            "run",
            "hit",
            "device",
            *pooled,
            "persistent peak",
            "window at peak",
            "SWA pool peak",
            "replays",
        )
        table = Table(title="policy comparison (model-free; --json or --report for every column)")
        # a run's name whole, as --runs takes it back, however narrow the terminal
        table.add_column("run", min_width=max(len(r.config.run_name) for r in study.runs))
        for col in (*cols[1:], "recomputed", "GPU-s"):
            table.add_column(col, justify="right")
        for r, row in zip(study.runs, comparison_rows(study.runs), strict=True):
            s = r.summary
            table.add_row(
                r.config.run_name,
                *(str(row[c]) for c in cols[1:]),
                f"{s['recomputed_tokens'] / 1e6:,.1f}M",
                f"{s['prefill_gpu_s']:,.0f}",
            )
        console.print(table)
        console.print(study.runs[0].summary["cost_formula"], markup=False, highlight=False)
        for axis, points in study.sweeps.items():
            t = Table(title=f"sweep {axis} ({points[0][1].config.label})", title_justify="left")
            swept = [r for _, r in points]
            pooled = ("global pool",) if any(r.config.has_global_pool for r in swept) else ()
            sweep_cols = (
                "hit",
                "device",
                *pooled,
                "window restored",
                "replays",
                "SWA pool peak",
                "persistent peak",
            )
            for col in ("value", *sweep_cols):
                t.add_column(col, justify="right")
            for (label, _), rr in zip(points, comparison_rows(swept), strict=True):
                t.add_row(label, *(str(rr[c]) for c in sweep_cols))
            console.print(t)
        facts = out.get("findings") or {}
        for key, value in facts.items():
            console.print(f"{key:34s} {json.dumps(value)}", markup=False, highlight=False, soft_wrap=True)
        console.print(f"{'simulator_core':34s} {out['simulator_core']}", markup=False, highlight=False)
    if engine:
        from kvdiet.sim.report import ENGINE_COLUMNS, engine_row

        table = Table(title="engine mode (--json or --report for every column)", title_justify="left")
        rows = [engine_row(e.summary()) for e in engine]
        widest = max(len(r["run"]) for r in rows)  # a run's POLICY@MODEL in full: models may share a prefix
        for col in ENGINE_COLUMNS:
            left = col in ("run", "window sources")
            table.add_column(
                col, justify="left" if left else "right", min_width=widest if col == "run" else None
            )
        for row in rows:
            table.add_row(*row.values())
        console.print(table)
    if "report" in out:
        console.print(f"wrote {out['report']}", markup=False, highlight=False)
