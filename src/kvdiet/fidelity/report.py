"""``kvdiet fidelity --report DIR``: ``report.md`` with every table, and PNG plots (matplotlib).

Plots: ``cache_precision.png`` (KL and top-1 of each cache-precision variant vs context), ``selection.png``
(CSA2 top-k overlaps and candidate-pool recall vs context), ``replay.png`` (encoder-side replay KL and
continuation agreement vs hit length; decoder-side replay KL vs context). Lines that coincide are drawn once and
named together (`kvdiet.sim.plots.same_label`). Every file names the weights the figures come from.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvdiet.fidelity.experiments import Point
from kvdiet.sim.plots import same_label

__all__ = ["points_table", "write_report"]


def points_table(points: Sequence[Point]) -> str:
    """A markdown table of points: experiment, variant, measure, context, hit, value, n."""
    lines = [
        "| experiment | variant | measure | context | hit | value | n |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in points:
        hit = "" if p.hit is None else f"{p.hit:,}"
        lines.append(
            f"| {p.experiment} | {p.variant} | {p.measure} | {p.context:,} | {hit} | {p.value:.4g} | {p.n:,} |"
        )
    return "\n".join(lines) + "\n"


def _series(points: Sequence[Point], *, x: str = "context") -> dict[str, tuple[list[float], list[float]]]:
    """One line per variant (per context when x is the hit length), x ascending."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    for p in sorted(points, key=lambda p: getattr(p, x)):
        label = p.variant if x == "context" else f"context {p.context:,}"
        xs, ys = out.setdefault(label, ([], []))
        xs.append(getattr(p, x))
        ys.append(p.value)
    return out


def _grouped(points: Sequence[Point], decoder_start: int | None) -> list[Point]:
    """CSA2 points averaged over the layers of a group (Reuse in the encoder / the decoder, Reindex, pool)."""
    groups: dict[tuple[str, int], list[Point]] = {}
    for p in points:
        layer = int(re.search(r"L(\d+)", p.variant).group(1))
        if p.variant.startswith("reuse"):
            side = "decoder" if decoder_start is not None and layer >= decoder_start else "encoder"
            name = f"Reuse layers ({side}) vs own attention"
        elif p.variant.startswith("reindex"):
            name = "Reindex layers vs their KV source"
        else:
            name = "candidate-pool recall of the dense top-k"
        groups.setdefault((name, p.context), []).append(p)
    return [
        Point(
            ps[0].experiment, name, ps[0].measure, c, sum(q.value for q in ps) / len(ps), sum(q.n for q in ps)
        )
        for (name, c), ps in groups.items()
    ]


def _plot(
    ax, points: Sequence[Point], title: str, ylabel: str, *, x: str = "context", log: bool = False
) -> None:
    # lines that coincide are drawn once: {(xs, ys): their labels}
    drawn: dict[tuple[tuple[float, ...], tuple[float, ...]], list[str]] = {}
    for label, (xs, ys) in _series(points, x=x).items():
        drawn.setdefault((tuple(xs), tuple(ys)), []).append(label)
    for (xs, ys), labels in drawn.items():
        ax.plot(xs, [max(y, 1e-12) for y in ys] if log else ys, marker="o", label=same_label(labels))
    ax.set_title(title + (" (0 drawn at 1e-12)" if log else ""), fontsize=9)
    ax.set_xlabel("context (tokens)" if x == "context" else "prefix-hit length (tokens)")
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    if points:
        ax.legend(fontsize=6)


def write_report(directory: str | Path, result: dict, points: dict[str, list[Point]]) -> list[Path]:
    """Write ``report.md`` and the plots into ``directory`` (created); returns the files written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    label = result["weights_label"]
    cp, sel, rep = points["cache_precision"], points["csa2_selection"], points["replay"]
    files = []
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    _plot(axes[0], [p for p in cp if p.measure == "kl"], "KL(fp32 caches ‖ packed)", "nats", log=True)
    _plot(axes[1], [p for p in cp if p.measure == "top1"], "top-1 agreement", "share of rows")
    fig.suptitle(f"Cache precision — {label}", fontsize=9)
    files.append(_save(fig, out / "cache_precision.png"))
    fig, ax = plt.subplots(figsize=(7, 4))
    _plot(
        ax,
        _grouped(sel, result.get("decoder_start")),
        f"CSA2 selection — {label} (mean over layers)",
        "share",
    )
    files.append(_save(fig, out / "selection.png"))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    enc = [p for p in rep if p.variant == "encoder-side"]
    _plot(
        axes[0],
        [p for p in enc if p.measure == "kl"],
        "encoder-side replay: KL vs cold",
        "nats",
        x="hit",
        log=True,
    )
    _plot(
        axes[1],
        [p for p in enc if p.measure == "continuation"],
        "encoder-side: greedy agreement",
        "share",
        x="hit",
    )
    dec = [p for p in rep if p.variant == "decoder-side" and p.measure == "kl"]
    _plot(axes[2], dec, "decoder-side replay: KL vs full decoder", "nats", log=True)
    fig.suptitle(f"Bounded replay — {label}", fontsize=9)
    files.append(_save(fig, out / "replay.png"))
    md = [
        "# kvdiet fidelity",
        "",
        f"**Weights:** {label}",
        "",
        f"{result['caveat']}",
        "",
        f"Prompts: {result['prompts']} ({', '.join(result['prompt_names'])}); contexts "
        f"{', '.join(f'{c:,}' for c in result['contexts'])}; {result['rows']} rows per context; prefill chunks of "
        f"{result['chunk']:,}; continuation {result['continuation']} greedy tokens.",
        "",
        "KL is KL(exact ‖ approximate) of the next-token distribution in nats, averaged over rows; top1 the share "
        "of rows whose argmax agrees; max_abs_dlogit the mean over rows of max |Δlogit|; topk_overlap |A ∩ B| / k; "
        "recall the share of the dense top-k that the candidate pool keeps; continuation the share of greedy "
        "tokens that agree before the first difference.",
        "",
        "## 1. Cache precision (vs fp32 caches)",
        "",
        "![cache precision](cache_precision.png)",
        "",
        points_table(cp),
        "## 2. CSA2 selection (packed caches)",
        "",
        "![selection](selection.png)",
        "",
        points_table(sel),
        "## 3. Bounded replay",
        "",
        "![replay](replay.png)",
        "",
        points_table(rep),
    ]
    (out / "report.md").write_text("\n".join(md))
    return [out / "report.md", *files]


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
