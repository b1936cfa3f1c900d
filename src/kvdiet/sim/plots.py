"""The PNG plots of a trace-study report (matplotlib, headless): hit rate over time, persistent bytes over time,
recomputed tokens per run, SWA-pool restores and peak bytes vs TTL, other sweeps, and TTFT. Legends sit outside
the axes; lines that coincide are drawn once and named together (`identical_lines`); a time bucket no request
arrived in is a gap (`hit_gaps`). Each ``plot_*`` writes one file and returns its name.
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
from kvdiet.sim.study import CATCH_TARGET
from kvdiet.units import format_duration

__all__ = [
    "hit_gaps",
    "identical_lines",
    "persistent_lines",
    "plot_hits",
    "plot_persistent",
    "plot_recomputed",
    "plot_sweep",
    "plot_ttft",
    "plot_ttl",
    "same_label",
]


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


def _save(fig, path: Path) -> str:
    fig.savefig(path, dpi=110, bbox_inches="tight")  # legends placed outside the axes stay in the image
    plt.close(fig)
    return path.name


def _highlighted(runs: list[SimResult]) -> list[SimResult]:
    keys = [("bounded-replay", "deepseek-v4.1-flash"), ("boundary-snapshot", "deepseek-v4-flash")]
    picked = [r for k in keys for r in runs if (str(r.config.policy), r.config.model) == k]
    return picked or runs[:1]


def plot_hits(runs: list[SimResult], arrivals_s: list[float] | None, path: Path) -> str:
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


def persistent_lines(runs: list[SimResult]) -> list[tuple[list[str], list[float]]]:
    return identical_lines([(r.config.label, r.series["persistent_bytes"]) for r in runs])


def plot_persistent(runs: list[SimResult], path: Path) -> str:
    fig, ax = plt.subplots(figsize=(8, 4), layout="constrained")
    t = [x / 60 for x in runs[0].series["t_s"]]
    lines = persistent_lines(runs)
    for labels, values in lines:
        ax.plot(t, [b / 1e9 for b in values], label=same_label(labels))
    if any(b > 0 for _, values in lines for b in values):  # else nothing to put on a log axis (a warning)
        ax.set_yscale("log")
    ax.set_xlabel("trace time (min)")
    ax.set_ylabel("persistent bytes resident (GB)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, frameon=False)
    return _save(fig, path)


def same_label(labels: list[str]) -> str:
    """One legend entry for lines that coincide: ``a`` or ``a\n= b\n= c (identical)``."""
    return "\n= ".join(labels) + (" (identical)" if len(labels) > 1 else "")


def plot_recomputed(runs: list[SimResult], path: Path) -> str:
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


def plot_ttl(points: list[tuple[str, SimResult]], path: Path) -> str:
    bounded = points[:-1]
    ref = points[-1][1].summary["window_sources"][WindowSource.SWA_POOL] or 1
    ttl = [r.config.swa_pool_ttl_s for _, r in bounded]
    share = [r.summary["window_sources"][WindowSource.SWA_POOL] / ref for _, r in bounded]
    peak = [r.summary["swa_pool_bytes_peak"] / 1e9 for _, r in bounded]
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


def plot_sweep(axis: str, points: list[tuple[str, SimResult]], path: Path) -> str:
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    labels = [label for label, _ in points]
    lines = [(key.replace("_", " "), [r.summary[key] for _, r in points]) for key in _SWEEP_RATIOS]
    # the second ratio hollow and larger: where the two meet at a point, both markers still show
    styles = (
        {"marker": "o", "linestyle": "-"},
        {"marker": "s", "linestyle": "--", "markerfacecolor": "none", "ms": 9},
    )
    for (names, values), style in zip(identical_lines(lines), styles, strict=False):
        ax.plot(labels, values, label=same_label(names), **style)
    ax.set_ylim(0, 1)
    ax.set_xlabel(axis)
    ax.set_ylabel("share of prompt tokens hit")
    ax2 = ax.twinx()
    peaks = [r.summary["persistent_bytes_peak"] / 1e9 for _, r in points]
    ax2.plot(labels, peaks, "^:", color="tab:red", label="persistent peak bytes (GB, right)")
    ax2.set_ylabel("persistent peak bytes (GB)", color="tab:red")
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(
        handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3, frameon=False
    )
    ax.set_title(points[0][1].config.label, fontsize=10)
    return _save(fig, path)


def plot_ttft(engine: list[EngineModeResult], path: Path) -> str:
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
