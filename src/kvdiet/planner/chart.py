"""Charts of planner figures (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

from kvdiet.cache.spec import CacheSpec
from kvdiet.config import load_config

__all__ = ["DEFAULT_CHART_MODELS", "check_plot_path", "plot_global_kv"]

DEFAULT_CHART_MODELS = ("deepseek-v4.1-flash", "deepseek-v4-flash", "deepseek-llm-67b")


def check_plot_path(path: str | Path) -> Path:
    """``path`` as a Path if matplotlib can write its format there (checked before any work).

    Raises:
        ValueError: the name does not end in ``.png``, ``.svg`` or ``.pdf``; its directory does not exist
            (it is never created: a typo in it should not leave new directories behind), is not one, or is not
            writable (``/proc``: the report was printed, then the write failed).
    """
    out, shown = Path(path), str(path)
    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ValueError(f"plot file {shown!r} must end in .png, .svg or .pdf")
    parent = out.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise ValueError(f"plot file {shown!r}: the directory {str(parent)!r} {what}")
    existed = out.exists()
    try:  # opened for writing, as matplotlib will (permission bits say nothing to root, nor of /proc)
        with out.open("ab"):
            pass
    except OSError as exc:
        raise ValueError(f"plot file {shown!r}: {(exc.strerror or str(exc)).lower()}") from None
    if not existed:
        out.unlink(missing_ok=True)
    return out


def plot_global_kv(
    path: str | Path,
    *,
    models: tuple[str, ...] = DEFAULT_CHART_MODELS,
    max_tokens: int = 1_048_576,
    hbm_gb: float = 141.0,
) -> Path:
    """Draw global KV bytes of one request against context length (log y) for ``models``, with a
    horizontal line at one device's memory (default one H200, 141 GB). Returns the written path.

    Raises:
        ValueError: see `check_plot_path`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = check_plot_path(path)
    contexts = [2**k for k in range(10, max_tokens.bit_length())]
    if contexts[-1] != max_tokens:
        contexts.append(max_tokens)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for name in models:
        spec = CacheSpec.from_config(load_config(name))
        ys = [spec.global_bytes(n) / 1e9 for n in contexts]
        ax.plot(
            contexts,
            ys,
            marker="o",
            markersize=3,
            label=f"{name} ({spec.global_bytes_per_token:,.0f} B/token)",
        )
    ax.axhline(hbm_gb, color="black", linestyle="--", linewidth=1)
    ax.text(contexts[0], hbm_gb * 1.15, f"one H200: {hbm_gb:g} GB", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("global KV of one request (GB, log)")
    ax.set_title("Global KV cache vs context length")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
