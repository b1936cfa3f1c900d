"""Top-k and candidate-block selection over indexer scores: the compiled kernels against the pure-torch path.

The selections one decode step of V4.1 makes at long context (`kvdiet.model.selection`): the top 512 of a
1M-entry row (the candidate source, layer 20) and of 16 rows of 500K (a batch of 16 on an encoder Full layer,
compress ratio 2), and the 2,048 candidate blocks of 8 of a 1M-entry row. Each on distinct scores (``randn``)
and on tied ones (4,096 values tiled, as `bench_decode`'s caches are: ties at the threshold are common there);
the batch also with 15 short requests padded to the longest (``padded``).
Each figure is the median of ``--repeats`` calls after a warm-up, in process CPU ms (all threads; steady on
shared cores) and wall ms, for the compiled kernels and for the pure-torch path (``KVDIET_NATIVE_KERNELS=0``) in
the same run; the two results are compared (``same``: ``torch.equal`` of indices and valid flags). Fixed seed;
CPU only; prints a table, then one JSON line.

Unless set, ``OMP_WAIT_POLICY=PASSIVE`` (as `bench_formats`): GOMP's spin-wait stalls multi-threaded ops for a
scheduler quantum whenever another process shares the cores.

    python benchmarks/bench_select.py --threads 1
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when torch loads the OpenMP runtime

import json
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from rich.console import Console
from rich.table import Table

from kvdiet.cli import ArgumentParser
from kvdiet.formats import native
from kvdiet.model.selection import select_candidate_blocks, select_topk

SEED = 0
TOPK = 512  # config index_topk
BLOCK, BLOCKS = 8, 2048  # config candidate_block_size, candidate_topk_blocks


KINDS = ("distinct", "tied", "padded")


def scores(rows: int, n: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """fp32 [rows, n]: ``randn`` (distinct); 4,096 ``randn`` values tiled along each row (tied); or ``randn`` where
    every row but the first sees only its first n/64 entries, −inf past them (padded: a batch's short requests
    padded to its longest)."""
    if kind == "tied":
        return torch.randn(4096, generator=gen).repeat(-(-n // 4096))[:n].expand(rows, n).contiguous()
    out = torch.randn(rows, n, generator=gen)
    if kind == "padded":
        out[1:, n // 64 :] = float("-inf")
    return out


def timed(fn: Callable[[], tuple[torch.Tensor, torch.Tensor]], repeats: int) -> tuple[float, float, tuple]:
    """Median process CPU ms and wall ms of ``repeats`` calls after one warm-up, and the last result."""
    out = fn()
    cpu, wall = [], []
    for _ in range(repeats):
        c, w = time.process_time(), time.perf_counter()
        out = fn()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return statistics.median(cpu) * 1e3, statistics.median(wall) * 1e3, out


def select(name: str, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_topk`` of every row of ``s``, or its candidate blocks (every entry visible)."""
    if name == "select_topk":
        return select_topk(s, TOPK)
    visible = torch.full((s.shape[0],), s.shape[1])
    return select_candidate_blocks(s, visible, block_size=BLOCK, topk_blocks=BLOCKS)


CASES = [
    ("select_topk", (1, 1_000_000)),
    ("select_topk", (16, 500_000)),
    ("candidate_blocks", (1, 1_000_000)),
]


def measure(repeats: int) -> list[dict]:
    """One row per case and kind of scores: both paths' CPU and wall ms and whether their results agree."""
    gen = torch.Generator().manual_seed(SEED)
    rows = []
    for name, shape in CASES:
        for kind in KINDS:
            if kind == "padded" and shape[0] == 1:
                continue
            s = scores(*shape, kind, gen)
            row: dict = {"selection": name, "shape": list(shape), "scores": kind}
            results = []
            for path, env in (("native", "1"), ("torch", "0")):
                os.environ[native.ENV] = env
                row[f"{path}_cpu_ms"], row[f"{path}_wall_ms"], out = timed(partial(select, name, s), repeats)
                results.append(out)
            os.environ.pop(native.ENV)
            row["same"] = all(torch.equal(a, b) for a, b in zip(*results, strict=True))
            rows.append(row)
    return rows


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per figure; the median is kept")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if native.fp4_kernels() is None:
        raise SystemExit("the compiled kernels did not build: nothing to compare")
    rows = measure(args.repeats)
    if not args.json_only:
        table = Table(
            title=f"selection, k={TOPK} (blocks: {BLOCKS} of {BLOCK}), {torch.get_num_threads()} threads"
        )
        for col in ("selection", "shape", "scores", "native cpu ms", "torch cpu ms", "×", "native wall ms",
                    "torch wall ms", "×", "same"):  # fmt: skip
            table.add_column(col, justify="right")
        for r in rows:
            table.add_row(r["selection"], "×".join(map(str, r["shape"])), r["scores"],
                          f"{r['native_cpu_ms']:.2f}", f"{r['torch_cpu_ms']:.2f}",
                          f"{r['torch_cpu_ms'] / r['native_cpu_ms']:.1f}", f"{r['native_wall_ms']:.2f}",
                          f"{r['torch_wall_ms']:.2f}", f"{r['torch_wall_ms'] / r['native_wall_ms']:.1f}",
                          str(r["same"]))  # fmt: skip
        Console(width=150).print(table)
    print(json.dumps({"bench": "select", "threads": torch.get_num_threads(), "topk": TOPK, "rows": rows}))


if __name__ == "__main__":
    main()
