"""``kvdiet replay``: read a request trace and report its statistics."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

__all__ = ["add_replay_parser", "run_replay"]


def add_replay_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``replay`` sub-command to ``sub``."""
    rep = sub.add_parser(
        "replay",
        help="read a request trace and report its statistics and its infinite-cache prefix hit ratio",
        description="Read a Mooncake JSONL, generic JSONL or Azure CSV trace and print its requests, "
        "duration, prompt and output lengths, blocks and the share of blocks a cache that never forgets would "
        "hit by contiguous-prefix matching. (The tier simulation and the SWA-policy study build on this.)",
        epilog="example:\n  kvdiet replay ../shared/traces/mooncake/conversation_trace.jsonl --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rep.add_argument("trace", help="trace file (.jsonl or .csv)")
    rep.add_argument("--format", default="auto", choices=["auto", "mooncake", "jsonl", "azure"])
    rep.add_argument(
        "--strict", action="store_true", help="stop at the first malformed line (default: skip it)"
    )
    rep.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return rep


def run_replay(args: argparse.Namespace, console: Console) -> None:
    """Run ``kvdiet replay`` with parsed ``args``."""
    from kvdiet.sim.traces import read_trace, trace_stats

    trace = read_trace(args.trace, format=args.format, strict=args.strict)
    for line in trace.errors[:10]:
        print(f"kvdiet replay: skipped {line}", file=sys.stderr)
    stats = trace_stats(trace)
    if args.json:
        print(json.dumps(stats))
        return
    for key, value in stats.items():
        if isinstance(value, dict):
            text = ", ".join(f"{k} {v:,}" for k, v in value.items())
        else:
            text = str(value).lower() if isinstance(value, bool) else f"{value:,}"
        console.print(f"{key:32s} {text}", markup=False, highlight=False, soft_wrap=True)
