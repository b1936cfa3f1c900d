"""Terminal rendering of planner reports (rich tables). Reads only the report dicts of `report`."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from kvdiet.units import format_bytes, format_count, format_gb, format_tokens

__all__ = ["render_compare", "render_report"]


def _ids(ids: list[int]) -> str:
    """``[3, 4, 5, 7]`` → ``'3–5, 7'``."""
    runs: list[str] = []
    start = prev = None
    for i in [*ids, None]:
        if start is not None and (i is None or i != prev + 1):
            runs.append(str(start) if start == prev else f"{start}–{prev}")
            start = None
        if i is not None and start is None:
            start = i
        prev = i
    return ", ".join(runs)


def render_report(report: dict[str, Any], console: Console) -> None:
    """Print ``report`` as a sequence of tables."""
    console.print(f"[bold]{report['config']}[/bold]  ({report['model_type']}, {report['family']})")
    plan = report.get("layer_plan")
    if plan:
        t = Table(title="Layer plan")
        for col in ("role", "layers", "ids"):
            t.add_column(col)
        for role, ids in plan["roles"].items():
            t.add_row(role, str(len(ids)), _ids(ids))
        console.print(t)
        if plan["trailing_ratio_entries"]:
            console.print(
                f"  trailing compress_ratios entries (DSpark/MTP blocks, not layers): "
                f"{plan['trailing_ratio_entries']}"
            )

    t = Table(title="Global KV per token")
    t.add_column("component")
    t.add_column("bytes/token", justify="right")
    t.add_row("main KV", f"{report['components']['main_kv_bytes_per_token']:,.2f}")
    t.add_row("index keys", f"{report['components']['index_key_bytes_per_token']:,.2f}")
    t.add_row("[bold]total[/bold]", f"[bold]{report['global_bytes_per_token']:,.2f}[/bold]")
    if "encoder_bytes_per_token" in report["components"]:  # the total split by where its layers sit
        t.add_row("  of the total: encoder layers", f"{report['components']['encoder_bytes_per_token']:,.2f}")
        t.add_row("  of the total: decoder layers", f"{report['components']['decoder_bytes_per_token']:,.2f}")
    if "all_full_bytes_per_token" in report:
        t.add_row(
            "all-Full hypothetical",
            f"{report['all_full_bytes_per_token']:,.2f} ({report['all_full_ratio']:.1f}×)",
        )
    console.print(t)

    layers = [row for row in report["per_layer"] if row["compress_ratio"]]
    if layers and report["family"] != "dense":
        t = Table(title="Per KV-source layer")
        for col in ("layer", "ratio", "main", "index key", "bytes/token"):
            t.add_column(col, justify="right")
        for row in layers:
            index = (
                f"{row['index_key_bytes_per_entry']} B {row['index_key_format']}"
                if row["index_key_format"]
                else "—"
            )
            t.add_row(
                str(row["layer_id"]),
                str(row["compress_ratio"]),
                f"{row['main_bytes_per_entry']} B {row['main_format']}",
                index,
                f"{row['bytes_per_token']:.2f}",
            )
        console.print(t)

    w = report["window"]
    if w["layers"]:
        console.print(
            f"Window state per request: {w['layers']} layers × {w['window_tokens']} × {w['entry_bytes']} B "
            f"({w['entry_format']}) = {format_count(w['bytes_per_request'])} B "
            f"({format_bytes(w['bytes_per_request'])}); compressor tails "
            f"{format_count(report['compressor_tail_bytes_per_request'])} B"
        )

    t = Table(title="Per request at context")
    for col in ("context (tokens)", "global KV", "+ window + tails"):
        t.add_column(col, justify="right")
    for row in report["contexts"]:
        t.add_row(
            format_count(row["tokens"]), format_bytes(row["global_bytes"]), format_bytes(row["request_bytes"])
        )
    console.print(t)

    if "swa_policies" in report:
        t = Table(title="Persistent bytes per SWA policy")
        for col in ("policy", "exact", "bytes/token", "× global", "recompute on hit (tokens)"):
            t.add_column(col, justify="right")
        for row in report["swa_policies"]:
            t.add_row(
                row["policy"],
                "yes" if row["exact"] else "no",
                f"{row['amortised_bytes_per_token']:,.1f}",
                f"{row['ratio_to_global']:.2f}",
                format_count(row["recompute_tokens_on_hit"]),
            )
        console.print(t)

    c = report["capacity"]
    console.print(
        f"Capacity: {c['num_gpus']:,} × {c['gpu']} ({c['gpu_mem_gb']:,g} GB) − weights "
        f"{format_gb(c['weights_gb'])} GB ({c['weights_source']}) = {format_gb(c['kv_budget_gb'])} GB for KV → "
        f"[bold]{format_count(c['sessions'])}[/bold] sessions of {format_tokens(c['context'])} "
        f"({format_bytes(c['bytes_per_session'])} each)"
    )
    if c["warning"]:
        console.print(f"[bold yellow]warning:[/bold yellow] {c['warning']}", highlight=False)


def render_compare(result: dict[str, Any], console: Console) -> None:
    """Print two reports side by side (headline figures) with ``a / b`` ratios."""
    a, b, ratios = result["a"], result["b"], result["ratios"]
    t = Table(title=f"{a['config']} vs {b['config']}")
    t.add_column("figure")
    t.add_column(a["config"], justify="right")
    t.add_column(b["config"], justify="right")
    t.add_column("a / b", justify="right")

    def fmt_ratio(key: str) -> str:
        value = ratios.get(key)
        return "—" if value is None else f"{value:.3f}"

    t.add_row(
        "global bytes/token",
        f"{a['global_bytes_per_token']:,.2f}",
        f"{b['global_bytes_per_token']:,.2f}",
        fmt_ratio("global_bytes_per_token"),
    )
    t.add_row(
        "window bytes/request",
        format_count(a["window"]["bytes_per_request"]),
        format_count(b["window"]["bytes_per_request"]),
        fmt_ratio("window_bytes_per_request"),
    )
    t.add_row(
        "compressor tails/request",
        format_count(a["compressor_tail_bytes_per_request"]),
        format_count(b["compressor_tail_bytes_per_request"]),
        fmt_ratio("compressor_tail_bytes_per_request"),
    )
    for ca, cb in zip(a["contexts"], b["contexts"], strict=True):
        key = f"request_bytes@{ca['tokens']}"
        t.add_row(
            f"request at {format_count(ca['tokens'])}",
            format_bytes(ca["request_bytes"]),
            format_bytes(cb["request_bytes"]),
            fmt_ratio(key),
        )
    t.add_row(
        "sessions (capacity)",
        format_count(a["capacity"]["sessions"]),
        format_count(b["capacity"]["sessions"]),
        fmt_ratio("sessions"),
    )
    if "persistent_bounded_replay_vs_boundary_snapshot" in ratios:
        t.add_row(
            f"persistent (a replay / b snapshot, {format_count(result['tokens_per_boundary'])} tokens per boundary)",
            "",
            "",
            fmt_ratio("persistent_bounded_replay_vs_boundary_snapshot"),
        )
    console.print(t)
    cap_a, cap_b = a["capacity"], b["capacity"]  # the same devices and context; the weights are each config's
    console.print(
        f"Capacity of both: {cap_a['num_gpus']:,} × {cap_a['gpu']} ({cap_a['gpu_mem_gb']:,g} GB), sessions of "
        f"{format_tokens(cap_a['context'])}, after the weights: {a['config']} {format_gb(cap_a['weights_gb'])} GB "
        f"({cap_a['weights_source']}), {b['config']} {format_gb(cap_b['weights_gb'])} GB ({cap_b['weights_source']})"
    )
