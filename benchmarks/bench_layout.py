"""What the host memory layout buys a v4.1-mini decode step: weights packed in decode-read order on huge pages
(`kvdiet.model.weight_arena`) and the pool's pages on huge pages (`kvdiet.model.huge_pages`), each against torch's
own allocations, in one process.

Three copies of the same model (seed 0) with the same caches (filled as ``bench_decode.py`` fills them): ``torch``
(``load_model(pack=False)``, a pool with ``huge_pages=False``), ``weights`` (packed weights, that pool), ``both``
(packed weights, the default pool). Their logits are checked equal first. Then, round after round, each takes a
few decode steps in turn (the order rotates) and keeps the fastest: a neighbour's load or a slow moment of the
machine falls on all three alike, and the per-round differences against ``torch`` are what the table reports
(median, and in how many rounds the layout was the faster). Separate processes would not compare: two runs of the
same code differ here by more than these layouts do. Prints a table, then one JSON line.

    python benchmarks/bench_layout.py                            # 4K and 1,000K, 20 rounds; about a minute
    python benchmarks/bench_layout.py --contexts 4K --rounds 40
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from bench_decode import SEED, fill_state
from kvdiet.cli import ArgumentParser
from kvdiet.config import load_config
from kvdiet.model.build import load_model
from kvdiet.model.paged_pool import DevicePool
from kvdiet.model.state import RequestState
from kvdiet.model.transformer import Transformer
from kvdiet.units import count_list, positive_int

LAYOUTS = {
    "torch": (False, False),
    "weights": (True, False),
    "both": (True, True),
}  # (packed, huge-page pool)


def build(context: int, steps: int, packed: bool, huge_pool: bool) -> tuple[Transformer, RequestState]:
    """A model and a request state of ``context`` tokens in one layout (the same weights and caches in each), its
    pool holding ``steps`` decode steps more."""
    model, _ = load_model("v4.1-mini", seed=SEED, pack=packed)
    ratios = {s: model.plan[s].compress_ratio for s in model.plan.kv_sources}
    blocks = -(-(context + steps + 64) // 64)
    pool = DevicePool(ratios, model.codecs, num_blocks=blocks, huge_pages=huge_pool)
    torch.manual_seed(SEED)  # fill_state draws the Engram history from the global generator
    return model, fill_state(model, context, torch.Generator().manual_seed(SEED), pool)


def fastest_step(model: Transformer, state: RequestState, steps: int) -> float:
    """The fastest of ``steps`` decode steps (seconds)."""
    best = float("inf")
    for _ in range(steps):
        start = time.perf_counter()
        model.decode([state], [5])
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument(
        "--contexts",
        type=count_list,
        default="4Ki,1000Ki",
        help="decode contexts (tokens; the steps must fit too)",
    )
    parser.add_argument(
        "--rounds", type=positive_int, default=20, help="rounds; each layout takes its steps in each"
    )
    parser.add_argument("--steps", type=positive_int, default=5, help="decode steps a layout takes per round")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    steps = args.rounds * args.steps + 1  # every step each copy takes
    top = load_config("v4.1-mini").max_position_embeddings
    if max(args.contexts) + steps > top:
        parser.error(
            f"contexts plus the {steps:,} steps each copy takes must be at most the model's {top:,} positions"
        )
    rows = []
    for context in args.contexts:
        copies = {name: build(context, steps, *flags) for name, flags in LAYOUTS.items()}
        first = {name: m.decode([s], [5]) for name, (m, s) in copies.items()}
        if not all(torch.equal(first[name], first["torch"]) for name in first):
            raise SystemExit(
                f"context {context:,}: the layouts' logits differ (a layout must change no value)"
            )
        times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
        names = list(LAYOUTS)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name].append(fastest_step(*copies[name], args.steps))
        row = {"context": context, "torch_ms": statistics.median(times["torch"]) * 1e3}
        for name in ("weights", "both"):
            diffs = [(a - b) * 1e3 for a, b in zip(times[name], times["torch"], strict=True)]
            row[f"{name}_ms"] = statistics.median(times[name]) * 1e3
            row[f"{name}_minus_torch_ms"] = statistics.median(diffs)
            row[f"{name}_faster_rounds"] = sum(d < 0 for d in diffs)
        rows.append(row)
        del copies
    if not args.json_only:
        table = Table(
            title=f"v4.1-mini decode step by host layout ({args.rounds} rounds, fastest of {args.steps} steps)",
            caption="torch: torch's allocations; packed: the weights in decode-read order on huge pages; + pool: "
            "and the pool's pages on huge pages; Δ: the median per-round difference to torch; faster: rounds won",
        )
        for col in ("context", "torch ms", "packed ms", "Δ ms", "faster", "+ pool ms", "Δ ms", "faster"):
            table.add_column(col, justify="right")
        for r in rows:
            table.add_row(
                f"{r['context']:,}",
                f"{r['torch_ms']:.2f}",
                f"{r['weights_ms']:.2f}",
                f"{r['weights_minus_torch_ms']:+.2f}",
                f"{r['weights_faster_rounds']}/{args.rounds}",
                f"{r['both_ms']:.2f}",
                f"{r['both_minus_torch_ms']:+.2f}",
                f"{r['both_faster_rounds']}/{args.rounds}",
            )
        Console(width=120).print(table)
    print(json.dumps({"bench": "layout", "rounds": args.rounds, "steps": args.steps, "rows": rows}))


if __name__ == "__main__":
    main()
