"""Throughput of the packed cache formats against ``torch.clone`` of the same bf16 tensor.

For each format: ``encode_*`` (quantise + pack, fused) and ``decode_*`` (unpack + dequantise, fused) to
bfloat16 (the clone's output bytes; lossless, see ``scales.decode_rows``) and to float32, in GB/s of bf16
input, best of ``--repeats`` after an untimed warm-up on a slice, next to ``torch.clone`` of the same tensor
measured in the same run. Every call allocates its output, as the clone does. Prints a table, then one
JSON line. Fixed seed; CPU only; honours ``torch.set_num_threads`` (``--threads``).

``--clock cpu`` times process CPU seconds (all threads, user + system: page faults included) instead of wall
seconds: on cores shared with other jobs wall times swing several-fold between runs (the clone's too), CPU
times barely move.

Unless set, ``OMP_WAIT_POLICY=PASSIVE``: with GOMP's default spin-wait, every multi-threaded op stalls for
a scheduler quantum whenever another process shares the cores (figures then drop ~100×, clone included).

    python benchmarks/bench_formats.py --size-mb 256
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when torch loads the OpenMP runtime

import json
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

from kvdiet.cli import ArgumentParser
from kvdiet.formats import fp4, fp8, mxfp4, v4_record

# (format name, vector dim, encode, decode)
FORMATS: list[tuple[str, int, Callable, Callable]] = [
    ("fp4_e2m1_e4m3x16", 512, fp4.encode_main_kv, fp4.decode_main_kv),
    ("mxfp4", 128, mxfp4.encode_index_key, mxfp4.decode_index_key),
    ("mxfp8", 512, fp8.encode_window, fp8.decode_window),
    ("v4_fp8_record", 512, v4_record.encode_v4_record, v4_record.decode_v4_record),
]
FIGURES = ("pack", "unpack_bf16", "unpack_fp32")


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def best_seconds(
    fn: Callable[[torch.Tensor], object], arg: torch.Tensor, repeats: int, clock: str = "wall"
) -> float:
    """Best time (``clock``: wall or process CPU seconds) of ``repeats`` calls ``fn(arg)``, after an untimed
    warm-up on a slice of ``arg``."""
    now = CLOCKS[clock]
    fn(arg[: max(1, arg.shape[0] // 64)])
    best = float("inf")
    for _ in range(repeats):
        start = now()
        fn(arg)
        best = min(best, now() - start)
    return best


def measure(x: torch.Tensor, repeats: int, clock: str = "wall") -> tuple[float, dict[str, dict[str, float]]]:
    """Clone GB/s and, per format, GB/s of bf16 input and ratio to the clone for each of ``FIGURES``."""
    gb = x.numel() * x.element_size() / 1e9
    clone_gbps = gb / best_seconds(torch.clone, x, repeats, clock)
    results = {}
    for name, dim, encode, decode in FORMATS:
        xv = x.view(-1, dim)
        packed = encode(xv)
        seconds = {
            "pack": best_seconds(encode, xv, repeats, clock),
            "unpack_bf16": best_seconds(
                lambda p, d=decode: d(p, dtype=torch.bfloat16), packed, repeats, clock
            ),
            "unpack_fp32": best_seconds(decode, packed, repeats, clock),
        }
        r: dict[str, float] = {"bytes_per_entry": packed.shape[-1]}
        for key in FIGURES:
            r[f"{key}_gbps"] = gb / seconds[key]
            r[f"{key}_vs_clone"] = gb / seconds[key] / clone_gbps
        results[name] = r
        del packed
    return clone_gbps, results


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=256.0, help="bf16 input size in MiB (default 256)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure; the best is kept")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="wall or process CPU seconds")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = max(1, int(args.size_mb * 2**20) // (512 * 2))
    x = torch.randn(rows, 512, dtype=torch.bfloat16)
    clone_gbps, results = measure(x, args.repeats, args.clock)

    if not args.json_only:
        gb = x.numel() * 2 / 1e9
        title = f"bf16 [{rows}, 512] = {gb:.3f} GB, {torch.get_num_threads()} threads, {args.clock} clock"
        table = Table(title=title)
        heads = (
            "format",
            "B/entry",
            "encode GB/s",
            "×clone",
            "decode→bf16 GB/s",
            "×clone",
            "decode→fp32 GB/s",
            "×clone",
        )
        for col in heads:
            table.add_column(col, justify="right")
        table.add_row("torch.clone", "", f"{clone_gbps:.2f}", "1.00", "", "", "", "")
        for name, r in results.items():
            cells = [f"{r[f'{key}_{unit}']:.2f}" for key in FIGURES for unit in ("gbps", "vs_clone")]
            table.add_row(name, str(r["bytes_per_entry"]), *cells)
        Console(width=120).print(table)
    summary = {
        "bench": "formats",
        "input": f"bf16[{rows},512]",
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
        "repeats": args.repeats,
        "clock": args.clock,
        "clone_gbps": round(clone_gbps, 3),
        "formats": {name: {k: round(v, 3) for k, v in r.items()} for name, r in results.items()},
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
