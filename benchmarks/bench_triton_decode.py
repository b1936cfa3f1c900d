"""Packed-FP4 sparse decode attention (`kvdiet.model.triton_decode`) at 1M context: bytes of packed main KV read
per second, against the device's copy bandwidth and its tensor-core arithmetic rate, both measured in the same
run, and the nominal HBM bandwidth.

A layer's pool holds ``context / 2`` FP4 entries of 288 B (a ratio-2 Full layer, V4.1-Flash's 512-d latent).
Three reads are timed for every tile (`kvdiet.model.triton_decode.Tile`) in ``--tiles``, fixed seed, warm-up
excluded, best of ``--repeats``:

- ``dense``: one query of ``--heads`` heads over every entry (the whole compressed layer);
- ``topk``: ``--batch`` decode queries, each over its own ``index_topk`` (512) random entries;
- ``dense-h16``: the dense read with 16 heads (a quarter of the arithmetic per byte).

Bytes read = selected entries × 288 (queries and outputs are < 1% and not counted). Each entry costs
4 · heads · 512 FLOP (scores and output), so with 64 heads the read does 455 FLOP per byte: above an H200's
tensor-core ridge (measured fp16 matmul TFLOP/s ÷ copy GB/s), the read is arithmetic-bound, and the table
gives the bandwidth that the arithmetic allows (``compute cap``) beside the one reached. ``fp16x3`` and
``fp16x2`` do three and two tensor-core products for each useful one (`kvdiet.model.triton_decode.PRECISIONS`);
the cap counts that.

On a GPU run with ``--device cuda``; ``--device cpu`` runs Triton's interpreter (set ``TRITON_INTERPRET=1``) at
a small ``--context``, a dry run of this script. Goal (issue 16): ≥ 50% of HBM bandwidth at 1M on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

from kvdiet.cli import ArgumentParser
from kvdiet.device import add_device_arg, check_device, synchronize
from kvdiet.formats.fp4 import encode_main_kv
from kvdiet.model.triton_decode import DEFAULT_TILE, Tile, available, sparse_partials
from kvdiet.units import positive_count, positive_int

SEED = 0
DIM, ENTRY = 512, 288  # V4.1 main-KV latent and its packed entry (fp4_e2m1_e4m3x16)
TILES = "fp16x3:16:32:4,fp16x3:16:16:4,fp16x3:32:32:4,fp16x2:16:32:4,ieee:16:16:4"


def _best(fn, device: str, repeats: int) -> float:
    fn()  # warm-up (and the kernel's compilation)
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def copy_bandwidth(device: str, num_bytes: int, repeats: int) -> float:
    """Bytes per second of a device copy (read + write both counted: what HBM moves)."""
    x = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    return 2 * num_bytes / _best(x.clone, device, repeats)


def matmul_flops(device: str, repeats: int) -> float:
    """FLOP per second of an fp16 matrix product (8192³ on CUDA, 256³ on the CPU) with fp32 accumulation."""
    n = 8192 if device.startswith("cuda") else 256
    a = torch.randn(n, n, device=device).half()
    return 2 * n**3 / _best(lambda: a @ a, device, repeats)


def _name(tile: Tile) -> str:
    return f"{tile.precision}:{tile.block_h}:{tile.block_k}:{tile.num_warps}"


def parse_tiles(text: str) -> list[Tile]:
    """``precision:block_h:block_k:num_warps`` items, comma-separated; raises ValueError on a bad one."""
    tiles = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
            raise ValueError(f"--tiles: {item!r} is not precision:block_h:block_k:num_warps")
        tile = Tile(parts[0], *(int(p) for p in parts[1:]))
        tile.check()
        tiles.append(tile)
    return tiles


def main() -> None:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument(
        "--context", type=positive_count, default="1Mi", help="tokens of context (entries = context / 2)"
    )
    parser.add_argument(
        "--heads", type=positive_int, default=64, help="query heads sharing the latent (V4.1-Flash: 64)"
    )
    parser.add_argument("--batch", type=positive_int, default=128, help="decode queries of the top-k read")
    parser.add_argument(
        "--topk", type=positive_int, default=512, help="entries each top-k query reads (index_topk)"
    )
    parser.add_argument(
        "--splits", type=positive_int, default=1024, help="programs per query of the dense reads"
    )
    parser.add_argument(
        "--topk-splits", type=positive_int, default=4, help="programs per query of the top-k read"
    )
    parser.add_argument("--tiles", default=TILES, help=f"tiles to time (default {TILES})")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed runs, best kept")
    parser.add_argument("--hbm-gb-per-s", type=float, default=4800.0, help="nominal HBM GB/s (H200: 4,800)")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    add_device_arg(parser)
    args = parser.parse_args()
    try:
        check_device(args.device)
        tiles = parse_tiles(args.tiles)
    except ValueError as exc:
        parser.error(str(exc))
    n = args.context // 2
    if n < 1:
        parser.error("--context must be at least 2 tokens (one entry at ratio 2)")
    if not available():
        parser.error("triton does not import here (it is in the dev extra: pip install -e '.[dev]')")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--device cpu runs Triton's interpreter: set TRITON_INTERPRET=1")
    dev = args.device
    gen = torch.Generator().manual_seed(SEED)
    block = torch.randn(4096, DIM, generator=gen)
    rows = encode_main_kv(block).repeat(-(-n // 4096), 1)[:n].to(dev)  # [n, 288] packed, as in the pool
    scale = DIM**-0.5
    copy = copy_bandwidth(dev, min(rows.numel(), 1 << 30), args.repeats) / 1e9
    flops = matmul_flops(dev, args.repeats) / 1e12
    cases = {
        "dense": (1, n, args.splits, args.heads),
        "topk": (args.batch, min(args.topk, n), args.topk_splits, args.heads),
        "dense-h16": (1, n, args.splits, 16),
    }
    results = []
    for name, (b, k, splits, heads) in cases.items():
        q = (torch.randn(b, heads, DIM, generator=gen) * 0.05).to(dev)
        slots = torch.arange(n).expand(b, n) if k == n else torch.randint(0, n, (b, k), generator=gen)
        slots, valid = slots.to(dev), torch.ones(b, k, dtype=torch.bool, device=dev)
        useful = 4 * heads * DIM  # FLOP per entry: scores and output
        for tile in tiles:

            def read(q=q, slots=slots, valid=valid, splits=splits, tile=tile):
                return sparse_partials(q, rows, slots, valid, scale, splits=splits, tile=tile)

            try:
                seconds = _best(read, dev, args.repeats)
            except Exception as exc:  # a tile the compiler or the device refuses (registers, shared memory)
                results.append(
                    {"case": name, "tile": _name(tile), "error": f"{type(exc).__name__}: {exc}"[:300]}
                )
                continue
            done = {"fp16x3": 3, "fp16x2": 2}.get(tile.precision)  # tensor-core products per useful one
            cap = flops * 1e12 / (useful * done) * ENTRY / 1e9 if done else None
            results.append({"case": name, "tile": _name(tile),
                            "queries": b, "heads": heads, "entries_per_query": k, "splits": splits,
                            "bytes_read": b * k * ENTRY, "seconds": seconds,
                            "gb_per_s": b * k * ENTRY / seconds / 1e9,
                            "tflop_per_s": b * k * useful / seconds / 1e12,
                            "compute_cap_gb_per_s": cap})  # fmt: skip
    timed = [r for r in results if "error" not in r]
    for r in timed:
        r["of_copy"] = r["gb_per_s"] / copy
        r["of_hbm"] = r["gb_per_s"] / args.hbm_gb_per_s
    best = {
        c: max(rs, key=lambda r: r["gb_per_s"]) for c in cases if (rs := [r for r in timed if r["case"] == c])
    }
    default = _name(DEFAULT_TILE)
    result = {"bench": "triton_decode", "device": dev, "context": 2 * n, "heads": args.heads,
              "copy_gb_per_s": copy, "fp16_matmul_tflop_per_s": flops, "hbm_gb_per_s": args.hbm_gb_per_s,
              "default_tile": default, "cases": results,
              "best": {c: {"tile": r["tile"], "gb_per_s": r["gb_per_s"], "of_hbm": r["of_hbm"]}
                       for c, r in best.items()},
              "goal_half_hbm_met": "dense" in best and best["dense"]["of_hbm"] >= 0.5}  # fmt: skip
    if not args.json_only:
        table = Table(title=f"packed-FP4 decode attention, {2 * n:,} tokens of context on {dev}")
        for col in ("case", "tile", "queries × heads × entries", "µs", "GB/s", "of copy", "of HBM", "TFLOP/s",
                    "compute cap GB/s"):  # fmt: skip
            table.add_column(col, justify="right")
        for r in results:
            if "error" in r:
                table.add_row(r["case"], r["tile"], r["error"][:60], *[""] * 6)
                continue
            cap = f"{r['compute_cap_gb_per_s']:,.0f}" if r["compute_cap_gb_per_s"] else "—"
            table.add_row(r["case"], r["tile"], f"{r['queries']} × {r['heads']} × {r['entries_per_query']:,}",
                          f"{r['seconds'] * 1e6:,.0f}", f"{r['gb_per_s']:,.0f}", f"{r['of_copy']:.0%}",
                          f"{r['of_hbm']:.0%}", f"{r['tflop_per_s']:,.1f}", cap)  # fmt: skip
        console = Console(width=170)
        console.print(table)
        console.print(
            f"copy {copy:,.0f} GB/s; fp16 matmul {flops:,.0f} TFLOP/s; nominal HBM {args.hbm_gb_per_s:,.0f} GB/s"
        )
    print(json.dumps(result))
    if len(best) < len(cases):  # a case no tile could run: nothing was measured there
        sys.exit(
            f"bench_triton_decode: no tile ran for {sorted(set(cases) - set(best))} (errors in the table)"
        )


if __name__ == "__main__":
    main()
