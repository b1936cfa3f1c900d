"""``kvdiet replay --report DIR``: a markdown report with PNG plots (matplotlib) of a trace study.

Files written: ``report.md``; ``hit_rate_over_time.png`` (device and persistent hit ratio per time bucket),
``persistent_bytes.png`` (persistent bytes resident over trace time, one line per run),
``recomputed_tokens.png`` (prompt tokens computed and replayed per run), ``swa_pool_ttl.png`` (SWA-pool
restores vs TTL, with the pool's peak bytes) when the TTL was swept, ``sweep_<axis>.png`` for other sweeps,
and ``ttft.png`` (TTFT distribution) for an engine-mode run.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

from kvdiet.cache.plan import WindowSource

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvdiet.sim.engine_mode import EngineModeResult
from kvdiet.sim.records import SimResult
from kvdiet.sim.study import CATCH_TARGET, Study
from kvdiet.units import format_bytes

__all__ = ["comparison_rows", "write_report"]

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


def _table(rows: list[dict[str, object]]) -> str:
    if not rows:
        return "(none)\n"
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(r[k]) for k in head) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def _highlighted(runs: list[SimResult]) -> list[SimResult]:
    keys = [("bounded-replay", "deepseek-v4.1-flash"), ("boundary-snapshot", "deepseek-v4-flash")]
    picked = [r for k in keys for r in runs if (str(r.config.policy), r.config.model) == k]
    return picked or runs[:1]


def _plot_hits(runs: list[SimResult], path: Path) -> str:
    picked = _highlighted(runs)
    fig, axes = plt.subplots(len(picked), 1, figsize=(8, 2.8 * len(picked)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], picked, strict=True):
        t = [x / 60 for x in r.series["t_s"]]
        ax.stackplot(
            t,
            r.series["device_hit"],
            r.series["persistent_hit"],
            labels=["device pool", "persistent tier"],
            alpha=0.8,
        )
        ax.set_ylim(0, 1)
        ax.set_ylabel("prompt tokens hit")
        ax.set_title(r.config.label, fontsize=10)
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("trace time (min)")
    return _save(fig, path)


def _plot_persistent(runs: list[SimResult], path: Path) -> str:
    fig, ax = plt.subplots(figsize=(8, 4))
    for r in runs:
        ax.plot(
            [x / 60 for x in r.series["t_s"]],
            [b / 1e9 for b in r.series["persistent_bytes"]],
            label=r.config.label,
        )
    ax.set_yscale("log")
    ax.set_xlabel("trace time (min)")
    ax.set_ylabel("persistent bytes resident (GB)")
    ax.legend(fontsize=7)
    return _save(fig, path)


def _plot_recomputed(runs: list[SimResult], path: Path) -> str:
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(runs) + 1.5))
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
    ax.invert_yaxis()
    ax.set_xlabel("prompt tokens recomputed (millions)")
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def _plot_ttl(points: list[tuple[str, SimResult]], path: Path) -> str:
    bounded = points[:-1]
    ref = points[-1][1].summary["window_sources"][WindowSource.SWA_POOL] or 1
    ttl = [r.config.swa_pool_ttl_s for _, r in bounded]
    share = [r.summary["window_sources"][WindowSource.SWA_POOL] / ref for _, r in bounded]
    peak = [max(r.series["swa_pool_bytes"], default=0) / 1e9 for _, r in bounded]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(ttl, share, "o-", label="restores / unbounded pool's")
    ax.axhline(CATCH_TARGET, color="grey", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("SWA-pool TTL (s)")
    ax.set_ylabel("share of catchable window restores")
    ax2 = ax.twinx()
    ax2.plot(ttl, peak, "s--", color="tab:orange", label="pool peak (GB)")
    ax2.set_ylabel("SWA-pool peak bytes (GB)")
    fig.legend(loc="center right", fontsize=8)
    return _save(fig, path)


def _plot_sweep(axis: str, points: list[tuple[str, SimResult]], path: Path) -> str:
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [label for label, _ in points]
    ax.plot(labels, [r.summary["hit_ratio"] for _, r in points], "o-", label="hit ratio")
    ax.plot(labels, [r.summary["device_hit_ratio"] for _, r in points], "s--", label="device hit ratio")
    ax.set_ylim(0, 1)
    ax.set_xlabel(axis)
    ax2 = ax.twinx()
    ax2.plot(labels, [r.summary["persistent_bytes_resident"] / 1e9 for _, r in points], "^:", color="tab:red")
    ax2.set_ylabel("persistent bytes (GB)", color="tab:red")
    ax.legend(fontsize=8)
    ax.set_title(points[0][1].config.label, fontsize=10)
    return _save(fig, path)


def _plot_ttft(engine: list[EngineModeResult], path: Path) -> str:
    fig, ax = plt.subplots(figsize=(7, 4))
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
    ax.legend(fontsize=8)
    return _save(fig, path)


def write_report(
    out_dir: str | Path,
    *,
    trace_name: str,
    stats: dict[str, object],
    study: Study | None = None,
    facts: dict[str, object] | None = None,
    engine: list[EngineModeResult] | None = None,
    command: str = "",
) -> Path:
    """Write ``report.md`` and its plots into ``out_dir`` (created); returns the markdown path.

    Raises:
        OSError: ``out_dir`` cannot be created or written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = [f"# Trace study: {trace_name}\n"]
    if command:
        md.append(f"Reproduce: `{command}`\n")
    md.append("## Trace\n")
    md.append(
        _table(
            [{"figure": k, "value": json.dumps(v) if isinstance(v, dict) else v} for k, v in stats.items()]
        )
    )
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
        md.append(f"\n![hit rate over time]({_plot_hits(runs, out / 'hit_rate_over_time.png')})\n")
        md.append(f"\n![persistent bytes]({_plot_persistent(runs, out / 'persistent_bytes.png')})\n")
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
        f"device pool {format_bytes(c.device_bytes)}, persistent {persistent} TTL {c.persistent_ttl_s:g} s, "
        f"SWA pool {format_bytes(c.swa_pool_bytes)} TTL {c.swa_pool_ttl_s:g} s."
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
            f"{shares}; the shortest swept TTL reaching {f['catch_target']:.0%}: **{f['ttl_for_catch']}**. "
            f"Ages of the snapshots an unbounded pool restores: p50 {f['snapshot_age_p50_s']} s, "
            f"p90 {f['snapshot_age_p90_s']} s, p99 {f['snapshot_age_p99_s']} s."
        )
    return "\n".join(lines) + "\n"
