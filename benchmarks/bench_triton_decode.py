"""Packed-FP4 sparse decode attention (`kvdiet.model.triton_decode`) at 1M context: bytes of packed main KV read
per second, against the device's copy bandwidth measured in the same run and its nominal HBM bandwidth.

A layer's pool holds ``context / 2`` FP4 entries of 288 B (a ratio-2 Full layer, V4.1-Flash's 512-d latent).
Two reads are timed, fixed seed, warm-up excluded, best of ``--repeats``:

- ``dense``: one query over every entry (the whole compressed layer: the bandwidth-bound case);
- ``topk``: ``--batch`` decode queries, each over its own ``index_topk`` (512) random entries.

Bytes read = selected entries × 288 (queries and outputs are < 1% and not counted). On a GPU run with
``--device cuda``; ``--device cpu`` runs Triton's interpreter (set ``TRITON_INTERPRET=1``) at a small
``--context``, a dry run of this script. Goal (issue 16): ≥ 50% of HBM bandwidth at 1M on the GPU.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from rich.console import Console
from rich.table import Table

from kvdiet.device import add_device_arg, check_device, synchronize
from kvdiet.formats.fp4 import encode_main_kv
from kvdiet.model.triton_decode import sparse_partials
from kvdiet.units import parse_count

SEED = 0
DIM, ENTRY = 512, 288  # V4.1 main-KV latent and its packed entry (fp4_e2m1_e4m3x16)


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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--context", default="1Mi", help="tokens of context (entries = context / 2)")
    parser.add_argument(
        "--heads", type=int, default=64, help="query heads sharing the latent (V4.1-Flash: 64)"
    )
    parser.add_argument("--batch", type=int, default=128, help="decode queries of the top-k read")
    parser.add_argument("--topk", type=int, default=512, help="entries each top-k query reads (index_topk)")
    parser.add_argument("--splits", type=int, default=1024, help="programs per query of the dense read")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs, best kept")
    parser.add_argument("--hbm-gb-per-s", type=float, default=4800.0, help="nominal HBM GB/s (H200: 4,800)")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    add_device_arg(parser)
    args = parser.parse_args()
    check_device(args.device)
    dev = args.device
    gen = torch.Generator().manual_seed(SEED)
    n = parse_count(args.context) // 2
    block = torch.randn(4096, DIM, generator=gen)
    rows = encode_main_kv(block).repeat(-(-n // 4096), 1)[:n].to(dev)  # [n, 288] packed, as in the pool
    scale = DIM**-0.5
    results = []
    cases = {
        "dense": (1, n, args.splits),
        "topk": (args.batch, min(args.topk, n), 1),
    }
    for name, (b, k, splits) in cases.items():
        q = (torch.randn(b, args.heads, DIM, generator=gen) * 0.05).to(dev)
        slots = torch.arange(n).expand(b, n) if k == n else torch.randint(0, n, (b, k), generator=gen)
        slots, valid = slots.to(dev), torch.ones(b, k, dtype=torch.bool, device=dev)

        def read(q=q, slots=slots, valid=valid, splits=splits):
            return sparse_partials(q, rows, slots, valid, scale, splits=splits)

        seconds = _best(read, dev, args.repeats)
        results.append({"case": name, "queries": b, "entries_per_query": k, "splits": splits,
                        "bytes_read": b * k * ENTRY, "seconds": seconds,
                        "gb_per_s": b * k * ENTRY / seconds / 1e9})  # fmt: skip
    copy = copy_bandwidth(dev, min(rows.numel(), 1 << 30), args.repeats) / 1e9
    for r in results:
        r["of_copy"] = r["gb_per_s"] / copy
        r["of_hbm"] = r["gb_per_s"] / args.hbm_gb_per_s
    result = {"bench": "triton_decode", "device": dev, "context": 2 * n, "heads": args.heads,
              "copy_gb_per_s": copy, "hbm_gb_per_s": args.hbm_gb_per_s, "cases": results,
              "goal_half_hbm_met": results[0]["of_hbm"] >= 0.5}  # fmt: skip
    if not args.json_only:
        table = Table(
            title=f"packed-FP4 decode attention, {2 * n:,} tokens of context, {args.heads} heads on {dev}"
        )
        for col in ("case", "queries × entries", "MB read", "µs", "GB/s", "of copy", "of HBM"):
            table.add_column(col, justify="right")
        for r in results:
            table.add_row(r["case"], f"{r['queries']} × {r['entries_per_query']:,}", f"{r['bytes_read'] / 1e6:,.1f}",
                          f"{r['seconds'] * 1e6:,.0f}", f"{r['gb_per_s']:,.0f}", f"{r['of_copy']:.0%}",
                          f"{r['of_hbm']:.0%}")  # fmt: skip
        Console(width=150).print(table)
        Console(width=150).print(
            f"copy bandwidth {copy:,.0f} GB/s; nominal HBM {args.hbm_gb_per_s:,.0f} GB/s"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
