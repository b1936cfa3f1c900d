"""``kvdiet replay --report DIR``: a markdown report with PNG plots (matplotlib) of a trace study.

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

import bisect
import math
from pathlib import Path

import matplotlib

from kvdiet.cache.plan import WindowSource

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvdiet.sim.engine_mode import EngineModeResult
from kvdiet.sim.records import SimResult
from kvdiet.sim.study import CATCH_TARGET, Study
from kvdiet.units import format_bytes, format_duration

__all__ = ["ENGINE_COLUMNS", "comparison_rows", "engine_row", "hit_gaps", "identical_lines", "write_report"]

_RESTORED = (WindowSource.SWA_POOL, WindowSource.PERSISTENT, WindowSource.WINDOW_BLOCKS)
"""Window sources that restore stored state (the others replay or start cold)."""


def comparison_rows(runs: list[SimResult]) -> list[dict[str, object]]:
    """One row per run: the columns of the policy-comparison table (also printed by the CLI)."""
    rows = []
    for r in runs:
        s = r.summary
        src = s["window_sources"]
        rows.append(
            {
                "run": r.config.label,
                "hit": f"{s['hit_ratio']:.1%}",
                "device": f"{s['device_hit_ratio']:.1%}",
                "persistent": f"{s['persistent_hit_ratio']:.1%}",
                "persistent bytes": format_bytes(s["persistent_bytes_resident"]),
                "of which window": format_bytes(s["persistent_window_bytes"]),
                "SWA pool peak": format_bytes(max(r.series["swa_pool_bytes"], default=0)),
                "window restored": f"{sum(src[k] for k in _RESTORED):,}",
                "replays": f"{src[WindowSource.REPLAY]:,}",
                "replayed tokens": f"{s['replayed_tokens']:,}",
                "computed tokens": f"{s['computed_tokens']:,}",
                "prefill GPU-s": f"{s['prefill_gpu_s']:,.0f}",
            }
        )
    return rows


ENGINE_COLUMNS = (
    "policy",
    "requests",
    "device hit",
    "persistent hit",
    "window sources",
    "replayed",
    "computed",
    "TTFT p50",
    "TTFT p90",
    "agreeing",
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
                str(summary["policy"]),
                f"{summary['requests']:,}",
                f"{summary['device_hit_ratio']:.1%}",
                f"{summary['persistent_hit_ratio']:.1%}",
                _cell(summary["window_sources"]),
                f"{summary['replayed_tokens']:,}",
                f"{summary['computed_tokens']:,}",
                seconds(summary["ttft_p50_s"]),
                seconds(summary["ttft_p90_s"]),
                str(summary["model_free_agreeing"]),
            ),
            strict=True,
        )
    )


def hit_gaps(series: list[float], t_s: list[float], arrivals_s: list[float]) -> list[float]:
    """``series`` with NaN for each bucket no request arrived in: bucket i holds the arrivals in
    ``(t_s[i-1], t_s[i]]`` (bucket 0: up to ``t_s[0]``), as the simulator samples them (seconds)."""
    arrivals = sorted(arrivals_s)
    out, lo = [], 0
    for value, t in zip(series, t_s, strict=True):
        hi = bisect.bisect_right(arrivals, t)
        out.append(value if hi > lo else math.nan)
        lo = hi
    return out


def identical_lines(lines: list[tuple[str, list[float]]]) -> list[tuple[list[str], list[float]]]:
    """Group (label, values) lines with equal values, in first-seen order: each group is drawn once."""
    groups: dict[tuple[float, ...], list[str]] = {}
    for label, values in lines:
        groups.setdefault(tuple(values), []).append(label)
    return [(labels, list(values)) for values, labels in groups.items()]


def _cell(value: object) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_cell(v)}" for k, v in value.items()) or "-"
    if isinstance(value, bool) or value is None:
        return str(value).lower() if value is not None else "-"
    return f"{value:,}" if isinstance(value, int | float) else str(value)


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


def _save(fig, path: Path) -> str:
    fig.savefig(path, dpi=110, bbox_inches="tight")  # legends placed outside the axes stay in the image
    plt.close(fig)
    return path.name


def _highlighted(runs: list[SimResult]) -> list[SimResult]:
    keys = [("bounded-replay", "deepseek-v4.1-flash"), ("boundary-snapshot", "deepseek-v4-flash")]
    picked = [r for k in keys for r in runs if (str(r.config.policy), r.config.model) == k]
    return picked or runs[:1]


def _plot_hits(runs: list[SimResult], arrivals_s: list[float] | None, path: Path) -> str:
    picked = _highlighted(runs)
    fig, axes = plt.subplots(
        len(picked), 1, figsize=(8, 2.8 * len(picked)), sharex=True, squeeze=False, layout="constrained"
    )
    for ax, r in zip(axes[:, 0], picked, strict=True):
        t_s = r.series["t_s"]
        device, persistent = r.series["device_hit"], r.series["persistent_hit"]
        if arrivals_s is not None:
            device, persistent = hit_gaps(device, t_s, arrivals_s), hit_gaps(persistent, t_s, arrivals_s)
        ax.stackplot(
            [x / 60 for x in t_s], device, persistent, labels=["device pool", "persistent tier"], alpha=0.8
        )
        ax.set_ylim(0, 1)
        ax.set_ylabel("prompt tokens hit")
        ax.set_title(r.config.label, fontsize=10)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    axes[-1, 0].set_xlabel("trace time (min); gaps: no request arrived")
    return _save(fig, path)


def _persistent_lines(runs: list[SimResult]) -> list[tuple[list[str], list[float]]]:
    return identical_lines([(r.config.label, r.series["persistent_bytes"]) for r in runs])


def _plot_persistent(runs: list[SimResult], path: Path) -> str:
    fig, ax = plt.subplots(figsize=(8, 4), layout="constrained")
    t = [x / 60 for x in runs[0].series["t_s"]]
    for labels, values in _persistent_lines(runs):
        ax.plot(t, [b / 1e9 for b in values], label=_same_label(labels))
    ax.set_yscale("log")
    ax.set_xlabel("trace time (min)")
    ax.set_ylabel("persistent bytes resident (GB)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, frameon=False)
    return _save(fig, path)


def _same_label(labels: list[str]) -> str:
    """One legend entry for lines that coincide: ``a`` or ``a\n= b\n= c (identical)``."""
    return "\n= ".join(labels) + (" (identical)" if len(labels) > 1 else "")


def _plot_recomputed(runs: list[SimResult], path: Path) -> str:
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(runs) + 1.8), layout="constrained")
    labels = [r.config.label for r in runs]
    computed = [r.summary["computed_tokens"] / 1e6 for r in runs]
    replayed = [r.summary["replayed_tokens"] / 1e6 for r in runs]
    ax.barh(labels, computed, label="computed from the hit")
    ax.barh(labels, replayed, left=computed, label="replayed below the hit")
    for i, r in enumerate(runs):
        ax.text(
            computed[i] + replayed[i],
            i,
            f"  {r.summary['prefill_gpu_s']:,.0f} GPU-s",
            va="center",
            fontsize=7,
        )
    ax.set_xlim(0, 1.25 * max((c + p for c, p in zip(computed, replayed, strict=True)), default=0) or 1)
    ax.invert_yaxis()
    ax.set_xlabel("prompt tokens recomputed (millions)")
    ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0, 1.01), ncol=2, frameon=False)
    return _save(fig, path)


def _plot_ttl(points: list[tuple[str, SimResult]], path: Path) -> str:
    bounded = points[:-1]
    ref = points[-1][1].summary["window_sources"][WindowSource.SWA_POOL] or 1
    ttl = [r.config.swa_pool_ttl_s for _, r in bounded]
    share = [r.summary["window_sources"][WindowSource.SWA_POOL] / ref for _, r in bounded]
    peak = [max(r.series["swa_pool_bytes"], default=0) / 1e9 for _, r in bounded]
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    ax.plot(ttl, share, "o-", label="restores / unbounded pool's")
    ax.axhline(CATCH_TARGET, color="grey", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xticks(ttl, [format_duration(x) for x in ttl])
    ax.minorticks_off()
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("SWA-pool TTL")
    ax.set_ylabel("share of catchable window restores")
    ax2 = ax.twinx()
    ax2.plot(ttl, peak, "s--", color="tab:orange", label="pool peak (GB)")
    ax2.set_ylabel("SWA-pool peak bytes (GB)")
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.01), ncol=2, fontsize=8, frameon=False)
    return _save(fig, path)


_SWEEP_RATIOS = ("hit_ratio", "device_hit_ratio")


def _plot_sweep(axis: str, points: list[tuple[str, SimResult]], path: Path) -> str:
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    labels = [label for label, _ in points]
    lines = [(key.replace("_", " "), [r.summary[key] for _, r in points]) for key in _SWEEP_RATIOS]
    for (names, values), style in zip(identical_lines(lines), ("o-", "s--"), strict=False):
        ax.plot(labels, values, style, label=_same_label(names))
    ax.set_ylim(0, 1)
    ax.set_xlabel(axis)
    ax2 = ax.twinx()
    ax2.plot(labels, [r.summary["persistent_bytes_resident"] / 1e9 for _, r in points], "^:", color="tab:red")
    ax2.set_ylabel("persistent bytes (GB)", color="tab:red")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, frameon=False)
    ax.set_title(points[0][1].config.label, fontsize=10)
    return _save(fig, path)


def _plot_ttft(engine: list[EngineModeResult], path: Path) -> str:
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    for e in engine:
        xs = sorted(e.ttft_s)
        ax.plot(
            xs,
            [(i + 1) / len(xs) for i in range(len(xs))],
            drawstyle="steps-post",
            label=str(e.config.cache.policy),
        )
    ax.set_xlabel("TTFT (s, measured)")
    ax.set_ylabel("share of requests")
    ax.legend(fontsize=8, loc="best")
    return _save(fig, path)


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
        hits = _plot_hits(runs, arrivals_s, out / "hit_rate_over_time.png")
        md.append(f"\n![hit rate over time]({hits})\n")
        md.append(f"\n![persistent bytes]({_plot_persistent(runs, out / 'persistent_bytes.png')})\n")
        same = [labels for labels, _ in _persistent_lines(runs) if len(labels) > 1]
        if same:
            md.append("\nIdentical lines, each drawn once: " + "; ".join(" = ".join(g) for g in same) + ".\n")
        md.append(f"\n![recomputed tokens]({_plot_recomputed(runs, out / 'recomputed_tokens.png')})\n")
        for axis, points in study.sweeps.items():
            md.append(f"\n## Sweep: {axis} ({points[0][1].config.label})\n")
            md.append(_table([{"value": label} | _sweep_row(r) for label, r in points]))
            if axis == "swa-pool-ttl":
                md.append(f"\n![SWA-pool TTL]({_plot_ttl(points, out / 'swa_pool_ttl.png')})\n")
            else:
                md.append(f"\n![{axis}]({_plot_sweep(axis, points, out / f'sweep_{axis}.png')})\n")
    if engine:
        md.append("\n## Engine mode (the real kvdiet engine)\n")
        md.append(_table([e.summary() for e in engine]))
        md.append(f"\n![TTFT]({_plot_ttft(engine, out / 'ttft.png')})\n")
    md.append("\n## Assumptions\n")
    md.append(
        "- Requests are looked up at their arrival; their blocks and snapshots are stored when prefill ends "
        "(modelled GPU time) and when they finish (output tokens / `--output-tok-s`).\n"
        "- The trace's hash ids cover prompts only: output blocks are written but never hit.\n"
        "- Snapshot bytes are the window rings (`CacheSpec.window_bytes_per_request`); persistent bytes are "
        "payloads (entry headers excluded).\n"
        "- Blocks pinned by running requests are not modelled (the device pool is an LRU of blocks).\n"
    )
    path = out / "report.md"
    path.write_text("\n".join(chunk.strip("\n") + "\n" for chunk in md))  # a blank line between blocks
    return path


def _tiers(r: SimResult) -> str:
    c = r.config
    persistent = "unbounded" if c.persistent_bytes is None else format_bytes(c.persistent_bytes)
    return (
        f"device pool {format_bytes(c.device_bytes)}, persistent {persistent} TTL "
        f"{format_duration(c.persistent_ttl_s)}, SWA pool {format_bytes(c.swa_pool_bytes)} TTL "
        f"{format_duration(c.swa_pool_ttl_s)}."
    )


def _sweep_row(r: SimResult) -> dict[str, object]:
    s = r.summary
    return {
        "hit": f"{s['hit_ratio']:.1%}",
        "device": f"{s['device_hit_ratio']:.1%}",
        "SWA-pool restores": f"{s['window_sources'][WindowSource.SWA_POOL]:,}",
        "replays": f"{s['window_sources'][WindowSource.REPLAY]:,}",
        "SWA pool peak": format_bytes(max(r.series["swa_pool_bytes"], default=0)),
        "persistent bytes": format_bytes(s["persistent_bytes_resident"]),
        "prefill GPU-s": f"{s['prefill_gpu_s']:,.0f}",
    }


def _age(seconds: object) -> str:
    return "-" if seconds is None else format_duration(float(seconds))


def _facts_text(f: dict[str, object]) -> str:
    lines = []
    if f.get("persistent_ratio_v41_over_v4") is not None:
        lines.append(
            f"- Persistent bytes, V4.1 bounded-replay / V4-Flash boundary-snapshot: "
            f"**{f['persistent_ratio_v41_over_v4']:.3f}** ({format_bytes(f['persistent_bytes_v41'])} vs "
            f"{format_bytes(f['persistent_bytes_v4'])}); window snapshots are "
            f"**{f['v4_window_share']:.1%}** of V4's persistent bytes; global KV alone "
            f"{f['global_kv_ratio_v41_over_v4']:.3f}."
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
