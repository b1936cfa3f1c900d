"""``kvdiet replay --report DIR``: a markdown report of a trace study with the PNG plots of `kvdiet.sim.plots`.

Files written: ``report.md``; ``hit_rate_over_time.png`` (device and persistent hit ratio per time bucket;
a bucket no request arrived in is a gap),
``persistent_bytes.png`` (persistent bytes resident over trace time, one line per run),
``recomputed_tokens.png`` (prompt tokens computed and replayed per run), ``swa_pool_ttl.png`` (SWA-pool
restores vs TTL, with the pool's peak bytes) when the TTL was swept, ``sweep_<axis>.png`` for other sweeps,
and ``ttft.png`` (TTFT distribution) for an engine-mode run. Legends sit outside the axes; lines that
coincide are drawn once, named together, and noted in ``report.md``. Durations print in human units
(`kvdiet.units.format_duration`), nested figures as ``key: value`` lists.
"""

from __future__ import annotations

from pathlib import Path

from kvdiet.cache.plan import WindowSource
from kvdiet.cache.policies import BoundedReplay
from kvdiet.sim.engine_mode import EngineModeResult
from kvdiet.sim.plots import (
    persistent_lines,
    plot_hits,
    plot_persistent,
    plot_recomputed,
    plot_sweep,
    plot_ttft,
    plot_ttl,
)
from kvdiet.sim.reblock import reblock_note
from kvdiet.sim.records import SimResult
from kvdiet.sim.study import Study
from kvdiet.units import format_bytes, format_duration

__all__ = ["ENGINE_COLUMNS", "comparison_rows", "engine_row", "split_rows", "write_report"]

_RESTORED = (WindowSource.SWA_POOL, WindowSource.PERSISTENT, WindowSource.WINDOW_BLOCKS)
"""Window sources that restore stored state (the others replay or start cold)."""


def _global_cell(runs: list[SimResult], r: SimResult) -> dict[str, str]:
    """The ``global pool`` column (its hit ratio; ``-`` for a run without one), when any of ``runs`` has one."""
    if not any(x.config.has_global_pool for x in runs):
        return {}
    ratio = r.summary.get("global_pool_hit_ratio")
    return {"global pool": "-" if ratio is None else f"{ratio:.1%}"}


def comparison_rows(runs: list[SimResult]) -> list[dict[str, object]]:
    """One row per run: the columns of the policy-comparison table (also printed by the CLI); a ``global pool``
    column (its hit ratio) when a run has the shared global-KV DRAM tier."""
    rows = []
    for r in runs:
        s = r.summary
        src = s["window_sources"]
        rows.append(
            {
                "run": r.config.label,
                "hit": f"{s['hit_ratio']:.1%}",
                "device": f"{s['device_hit_ratio']:.1%}",
                **_global_cell(runs, r),
                "persistent": f"{s['persistent_hit_ratio']:.1%}",
                "persistent peak": format_bytes(s["persistent_bytes_peak"]),
                "window at peak": f"{s['persistent_window_share_at_peak']:.1%}",
                "persistent written": format_bytes(s["persistent_bytes_written"]),
                "persistent mean": format_bytes(s["persistent_bytes_mean"]),
                "SWA pool peak": format_bytes(s["swa_pool_bytes_peak"]),
                "window restored": f"{sum(src[k] for k in _RESTORED):,}",
                "replays": f"{src[WindowSource.REPLAY]:,}",
                "replayed tokens": f"{s['replayed_tokens']:,}",
                "computed tokens": f"{s['computed_tokens']:,}",
                "prefill GPU-s": f"{s['prefill_gpu_s']:,.0f}",
            }
        )
    return rows


def split_rows(runs: list[SimResult], split: str) -> list[dict[str, object]]:
    """One row per run and group of ``split`` (``by_regime``, ``by_kind``, ``by_session``): which policy wins
    for which part of the traffic (`kvdiet.sim.breakdown`); none when the runs do not carry the split."""
    rows = []
    for r in runs:
        for group, g in r.summary.get(split, {}).items():
            rows.append(
                {
                    "run": r.config.label,
                    "group": group,
                    "requests": f"{g['requests']:,}",
                    "hit": f"{g['hit_ratio']:.1%}",
                    "restores": f"{g['restores']:,}",
                    "replays": f"{g['replays']:,}",
                    "recomputed tokens": f"{g['recomputed_tokens']:,}",
                    "persistent written": format_bytes(g["persistent_bytes_written"]),
                    "SWA pool written": format_bytes(g["swa_pool_bytes_written"]),
                }
            )
    return rows


ENGINE_COLUMNS = (
    "run",
    "requests",
    "device hit",
    "persistent hit",
    "window sources",
    "replayed",
    "computed",
    "TTFT p50",
    "TTFT p90",
    "agreeing",
    "persistent written",
    "model-free persistent",
)
"""The engine-mode columns the terminal shows (`engine_row`); --json and report.md carry every figure."""


def engine_row(summary: dict[str, object]) -> dict[str, str]:
    """The `ENGINE_COLUMNS` of one engine-mode summary (`EngineModeResult.summary`), as text."""

    def seconds(v: object) -> str:
        return "-" if v is None else f"{v:.3f} s"

    return dict(
        zip(
            ENGINE_COLUMNS,
            (
                f"{summary['policy']}@{summary['model']}",
                f"{summary['requests']:,}",
                f"{summary['device_hit_ratio']:.1%}",
                f"{summary['persistent_hit_ratio']:.1%}",
                _cell(summary["window_sources"]),
                f"{summary['replayed_tokens']:,}",
                f"{summary['computed_tokens']:,}",
                seconds(summary["ttft_p50_s"]),
                seconds(summary["ttft_p90_s"]),
                str(summary["model_free_agreeing"]),
                format_bytes(summary["persistent_bytes_written"]),
                format_bytes(summary["model_free_persistent_bytes_written"]),
            ),
            strict=True,
        )
    )


def _cell(value: object) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_cell(v)}" for k, v in value.items()) or "-"
    if isinstance(value, bool) or value is None:
        return str(value).lower() if value is not None else "-"
    if isinstance(value, int | float):
        return f"{value:,}"
    text = str(value).replace("\\", "\\\\").replace("|", "\\|")  # a label's "|" must not split the row
    # nor a line break (a session file's id is any string) end it: non-printables as escapes (\n, \x1b)
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def _table(rows: list[dict[str, object]]) -> str:
    if not rows:
        return "(none)\n"
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cell(r[k]) for k in head) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _stats_rows(stats: dict[str, object]) -> list[dict[str, object]]:
    """The trace figures, a nested one as one row per key (``input_tokens: mean``)."""
    rows: list[dict[str, object]] = []
    for k, v in stats.items():
        items = v.items() if isinstance(v, dict) else [(None, v)]
        rows += [{"figure": k if sub is None else f"{k}: {sub}", "value": x} for sub, x in items]
    return rows


def write_report(
    out_dir: str | Path,
    *,
    trace_name: str,
    stats: dict[str, object],
    study: Study | None = None,
    facts: dict[str, object] | None = None,
    engine: list[EngineModeResult] | None = None,
    arrivals_s: list[float] | None = None,
    command: str = "",
) -> Path:
    """Write ``report.md`` and its plots into ``out_dir`` (created); returns the markdown path.
    ``arrivals_s`` (the trace's arrival times, seconds) marks the hit-rate buckets without requests as gaps.

    Raises:
        OSError: ``out_dir`` cannot be created or written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = [f"# Trace study: {trace_name}\n"]
    if command:
        md.append(f"Reproduce: `{command}`\n")
    md.append("## Trace\n")
    md.append(_table(_stats_rows(stats)))
    if study is not None and study.runs:
        runs = study.runs
        md.append("\n## Policy comparison (model-free)\n")
        md.append(_table(comparison_rows(runs)))
        md.append(
            f"\nCompute: {runs[0].summary['cost_formula']}; FLOPs per token from the config "
            "(`kvdiet.sim.cost`). Tiers: " + _tiers(runs[0]) + "\n"
        )
        if facts:
            md.append("\n## Findings\n")
            md.append(_facts_text(facts))
        hits = plot_hits(runs, arrivals_s, out / "hit_rate_over_time.png")
        for split, title in (("by_regime", "context-length regime"), ("by_kind", "traffic kind")):
            rows = split_rows(runs, split)
            if rows:
                md.append(f"\n## Policy comparison by {title}\n")
                md.append(_table(rows))
        headline = next((r for r in runs if isinstance(r.config.policy, BoundedReplay)), runs[0])
        sessions = split_rows([headline], "by_session")
        if sessions:
            md.append(f"\n## Per session ({headline.config.label})\n")
            md.append(_table([{k: v for k, v in row.items() if k != "run"} for row in sessions]))
        md.append(f"\n![hit rate over time]({hits})\n")
        md.append(f"\n![persistent bytes]({plot_persistent(runs, out / 'persistent_bytes.png')})\n")
        same = [labels for labels, _ in persistent_lines(runs) if len(labels) > 1]
        if same:
            md.append("\nIdentical lines, each drawn once: " + "; ".join(" = ".join(g) for g in same) + ".\n")
        md.append(f"\n![recomputed tokens]({plot_recomputed(runs, out / 'recomputed_tokens.png')})\n")
        for axis, points in study.sweeps.items():
            md.append(f"\n## Sweep: {axis} ({points[0][1].config.label})\n")
            swept = [r for _, r in points]
            md.append(_table([{"value": label} | _sweep_row(r, swept) for label, r in points]))
            if axis == "swa-pool-ttl":
                md.append(f"\n![SWA-pool TTL]({plot_ttl(points, out / 'swa_pool_ttl.png')})\n")
            else:
                md.append(f"\n![{axis}]({plot_sweep(axis, points, out / f'sweep_{axis}.png')})\n")
    if engine:
        md.append("\n## Engine mode (the real kvdiet engine)\n")
        md.append(_table([e.summary() for e in engine]))
        md.append(f"\n![TTFT]({plot_ttft(engine, out / 'ttft.png')})\n")
    md.append("\n## Assumptions\n")
    md.append(
        "- Requests are looked up at their arrival; their blocks and snapshots are stored when prefill ends "
        "(modelled GPU time) and when they finish (output tokens / `--output-tok-s`).\n"
        "- The trace's hash ids cover prompts only: output blocks are written but never hit.\n"
        "- Snapshot bytes are what the engine writes at that position (`CacheSpec.snapshot_bytes`: rings and "
        "their positions, the compressor rows held, Engram history; its JSON header excluded); persistent "
        "bytes are payloads (entry headers excluded).\n"
        "- Blocks pinned by running requests are not modelled (the device pool is an LRU of blocks).\n"
    )
    md[-1] += "".join(f"- {line}\n" for line in _reblocked(study, stats))  # in the same list
    path = out / "report.md"
    path.write_text("\n".join(chunk.strip("\n") + "\n" for chunk in md))  # a blank line between blocks
    return path


def _tiers(r: SimResult) -> str:
    c = r.config
    persistent = "unbounded" if c.persistent_bytes is None else format_bytes(c.persistent_bytes)
    pool = (
        f"global pool {format_bytes(c.global_pool_bytes)} TTL {format_duration(c.global_pool_ttl_s)}, "
        if c.has_global_pool
        else ""
    )
    return (
        f"device pool {format_bytes(c.device_bytes)}, {pool}persistent {persistent} TTL "
        f"{format_duration(c.persistent_ttl_s)}, SWA pool {format_bytes(c.swa_pool_bytes)} TTL "
        f"{format_duration(c.swa_pool_ttl_s)}."
    )


def _reblocked(study: Study | None, stats: dict[str, object]) -> list[str]:
    """One line per model whose runs ran at other blocks than the trace's (`kvdiet.sim.reblock`)."""
    trace_bs = stats.get("block_size")
    results = (
        [] if study is None else [*study.runs, *(r for points in study.sweeps.values() for _, r in points)]
    )
    seen = {r.config.model: r.summary["block_size"] for r in results}
    return [
        f"{reblock_note(model, bs, trace_bs)}: its hits, stores and snapshots are at its engine's block "
        "boundaries (`kvdiet.sim.reblock`)."
        for model, bs in seen.items()
        if isinstance(trace_bs, int) and bs != trace_bs
    ]


def _sweep_row(r: SimResult, runs: list[SimResult]) -> dict[str, object]:
    s = r.summary
    return {
        "hit": f"{s['hit_ratio']:.1%}",
        "device": f"{s['device_hit_ratio']:.1%}",
        **_global_cell(runs, r),
        "SWA-pool restores": f"{s['window_sources'][WindowSource.SWA_POOL]:,}",
        "replays": f"{s['window_sources'][WindowSource.REPLAY]:,}",
        "SWA pool peak": format_bytes(s["swa_pool_bytes_peak"]),
        "persistent peak": format_bytes(s["persistent_bytes_peak"]),
        "prefill GPU-s": f"{s['prefill_gpu_s']:,.0f}",
    }


def _age(seconds: object) -> str:
    return "-" if seconds is None else format_duration(float(seconds))


def _share(value: object, spec: str) -> str:
    """A ratio of the findings in ``spec``, or "n/a" where it has no denominator (None)."""
    return "n/a" if value is None else format(value, spec)


def _facts_text(f: dict[str, object]) -> str:
    lines = []
    if f.get("persistent_ratio_v41_over_v4") is not None:
        lines.append(
            f"- Persistent bytes at the peak, V4.1 bounded-replay / V4-Flash boundary-snapshot: "
            f"**{f['persistent_ratio_v41_over_v4']:.3f}** ({format_bytes(f['persistent_bytes_v41'])} vs "
            f"{format_bytes(f['persistent_bytes_v4'])}; of bytes written {f['persistent_ratio_written']:.3f}, "
            f"of byte-hours {f['persistent_ratio_byte_hours']:.3f}); window snapshots are "
            f"**{_share(f['v4_window_share'], '.1%')}** of V4's persistent bytes at its peak "
            f"({_share(f['v4_window_share_written'], '.1%')} of those written); global KV alone "
            f"{_share(f['global_kv_ratio_v41_over_v4'], '.3f')}."
        )
    if "ttl_catch_share" in f:
        shares = ", ".join(f"{k} {v:.0%}" for k, v in f["ttl_catch_share"].items())
        lines.append(
            f"- SWA-pool TTL: restores as a share of an unbounded pool's ({f['unbounded_pool_restores']:,}): "
            f"{shares}; the shortest swept TTL reaching {f['catch_target']:.0%}: "
            f"**{f['ttl_for_catch'] or 'none of them'}**. "
            "Ages of the snapshots an unbounded pool restores: "
            + ", ".join(f"{q} {_age(f.get(f'snapshot_age_{q}_s'))}" for q in ("p50", "p90", "p99"))
            + "."
        )
    return "\n".join(lines) + "\n"
