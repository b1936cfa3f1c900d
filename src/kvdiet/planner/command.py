"""``kvdiet plan``: flags, and the plan report of one config (or two side by side) as tables, JSON or a
plot (`kvdiet.planner.report`, `kvdiet.planner.render`, `kvdiet.planner.chart`)."""

from __future__ import annotations

import argparse
import json
import re
import sys

from rich.console import Console

from kvdiet.config import PRESETS, load_config
from kvdiet.planner.report import GPUS, PlanOptions, compare_reports, plan_report
from kvdiet.units import comma_items, parse_count, parse_flag

__all__ = ["add_plan_parser", "run_plan"]

EPILOG = """\
examples:
  kvdiet plan configs/deepseek-v4.1-flash.json            # the real V4.1-Flash config
  kvdiet plan deepseek-v4.1-flash --json                  # the same as JSON, for scripts
  kvdiet plan v4.1-mini --contexts 4K,32K,1Mi             # totals at chosen context lengths
  kvdiet plan deepseek-v4.1-flash --gpu b200 --num-gpus 4 --context 1M
  kvdiet plan --compare deepseek-v4.1-flash deepseek-v4-flash
  kvdiet plan --plot kv_vs_context.png

Units: token counts take decimal K/M (128K = 128,000) or binary Ki/Mi (1Mi = 1,048,576); bytes are
printed in decimal units (GB = 1e9 B). Presets: """ + ", ".join(PRESETS)


def add_plan_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``plan`` sub-command to ``sub``."""
    plan = sub.add_parser(
        "plan",
        help="layer plan, KV bytes per token, window state, SWA-policy storage and capacity of a config",
        description="Print the layer plan of a config and what its caches cost: global KV bytes per token "
        "by component and layer, the fixed window state per request, totals at context lengths, persistent "
        "bytes per SWA policy, and how many sessions fit on a set of GPUs after the weights (an upper bound: "
        "every byte past the weights holds KV, none is kept for activations).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument(
        "config",
        nargs="?",
        help="a preset name or a HF config.json path (default: deepseek-v4.1-flash; not with --compare)",
    )
    plan.add_argument("--json", action="store_true", help="print the report as one JSON object")
    plan.add_argument(
        "--compare", nargs=2, metavar=("A", "B"), help="two configs side by side, with A/B ratios"
    )
    plan.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw global KV vs context (V4.1-Flash, V4-Flash, DeepSeek-LLM-67B)",
    )
    plan.add_argument(
        "--contexts", default="4K,128K,1M", help="comma-separated context lengths (default 4K,128K,1M)"
    )
    plan.add_argument("--context", default="128K", help="context of one session for capacity (default 128K)")
    plan.add_argument(
        "--gpu",
        type=str.lower,  # a GPU's name in any case: H200 is h200
        choices=sorted(GPUS),
        default="h200",
        help="named device: "
        + ", ".join(f"{name} {gb:g} GB" for name, gb in GPUS.items())
        + " (default h200)",
    )
    plan.add_argument("--gpu-mem-gb", type=float, help="memory of one device in GB (overrides --gpu)")
    plan.add_argument(
        "--num-gpus",
        type=int,
        default=8,
        help="devices holding weights and cache; their bytes in all must be a finite float64 (default 8)",
    )
    plan.add_argument(
        "--weights-gb",
        type=float,
        help="device weight bytes in GB (default: estimated from each config; with --compare, both configs')",
    )
    plan.add_argument(
        "--tokens-per-boundary",
        default="1024",
        help="tokens between prompt/output ends, to amortise boundary snapshots over a session of 64 ends and "
        "64 blocks at least (default 1024; ends closer than a block snapshot once a block)",
    )
    plan.add_argument(
        "--checkpoint-every", default="4096", help="K of the checkpoint:K policy row (default 4096)"
    )
    return plan


_FLAGS = {
    "contexts": "--contexts",
    "capacity_context": "--context",
    "gpu_mem_gb": "--gpu-mem-gb",
    "num_gpus": "--num-gpus",
    "weights_gb": "--weights-gb",
    "tokens_per_boundary": "--tokens-per-boundary",
    "checkpoint_every": "--checkpoint-every",
}
"""`PlanOptions` field → the ``kvdiet plan`` flag that sets it (errors name the flag the user typed)."""


def _plan_options(args: argparse.Namespace) -> PlanOptions:
    """`PlanOptions` from the flags. Raises ValueError naming the flag: ``--num-gpus must be > 0, got 0``."""
    try:
        return PlanOptions(
            contexts=tuple(
                parse_flag("--contexts", parse_count, c)
                for c in comma_items("--contexts", args.contexts, "counts")
            ),
            capacity_context=parse_flag("--context", parse_count, args.context),
            gpu=args.gpu if args.gpu_mem_gb is None else "custom",
            gpu_mem_gb=GPUS[args.gpu] if args.gpu_mem_gb is None else args.gpu_mem_gb,
            num_gpus=args.num_gpus,
            weights_gb=args.weights_gb,
            tokens_per_boundary=parse_flag("--tokens-per-boundary", parse_count, args.tokens_per_boundary),
            checkpoint_every=parse_flag("--checkpoint-every", parse_count, args.checkpoint_every),
        )
    except ValueError as exc:
        raise _flag_named(exc, args) from None


def _flag_named(exc: ValueError, args: argparse.Namespace) -> ValueError:
    """``exc`` with the `PlanOptions` fields it names first (``num_gpus must be > 0, got 0``) spelled as the flags
    that set them; ``exc`` itself where it starts with no field."""
    if str(exc).partition(" ")[0] not in _FLAGS:
        return exc
    flags = _FLAGS if args.gpu_mem_gb is not None else _FLAGS | {"gpu_mem_gb": f"--gpu {args.gpu}"}
    return ValueError(re.sub(r"\b[a-z_]+\b", lambda m: flags.get(m[0], m[0]), str(exc)))


def run_plan(args: argparse.Namespace, console: Console) -> None:
    """Run ``kvdiet plan``. Raises ValueError/ConfigError on bad flags or configs (before any output)."""
    from kvdiet.planner.chart import check_plot_path
    from kvdiet.planner.render import render_compare, render_report

    if args.compare and args.config is not None:
        raise ValueError(f"give one config or --compare A B, not both (got {args.config!r} and --compare)")
    if args.plot is not None:  # '' too: refused by name, not ignored
        check_plot_path(args.plot)  # before any work
    options = _plan_options(args)
    names = args.compare or ["deepseek-v4.1-flash" if args.config is None else args.config]
    try:  # before any output: a report refuses options its model's engine would (`_flag_named`)
        reports = [plan_report(load_config(name), options) for name in names]
    except ValueError as exc:
        raise _flag_named(exc, args) from None
    if args.compare:
        result = compare_reports(*reports)
        if args.json:
            print(json.dumps(result))
        else:
            render_compare(result, console)
    else:
        if args.json:
            print(json.dumps(reports[0]))
        else:
            render_report(reports[0], console)
    for report in reports:
        # the text report prints the capacity warning under its capacity line; the context one only goes here
        shown = [report["context_warning"]] + (
            [report["capacity"]["warning"]] if args.json or args.compare else []
        )
        for warning in filter(None, shown):
            print(f"kvdiet plan: warning: {report['config']}: {warning}", file=sys.stderr)
    if args.plot:
        from kvdiet.planner.chart import plot_global_kv

        out = plot_global_kv(args.plot)
        (Console(stderr=True) if args.json else console).print(f"wrote {out}")
