"""Per-call time of `RMSNorm.forward`, `Rotation.apply` and a decode step's attention at a decode step's shapes:
the compiled kernels (``rms_norm``, ``rope_rotate``) against the torch formulas (``KVDIET_NATIVE_KERNELS=0``),
and `decode_attend` (``attend_rows``) against ``attend`` (the torch ops it replaces), and one decode row's index
scores (``index_scores``, the integer path) against the torch path, in one process; then a
prefill chunk's small batched products (`batched_product`: ``chain_bmm`` in the form its check found on this
machine, named in the row, against ``torch.bmm``; the same bits) at 1,024 rows: mHC's combᵀ·residual and
attention's probabilities times the window (40-layer tiny plan widths, v4.1-mini's hidden 256).

Shapes are v4.1-mini's (hidden 256, q_lora 128 and 512-wide heads for the norms; q [4, B, 512] as attention
passes it, transposed, its inverse, and kv [B, 512] for RoPE, rope_dim 64; 4 heads × 512 dims over a window of
128 keys and 512 selected entries, or the window alone, for attention; one MXFP4 index query of 4 heads × 128
against 16,384 packed keys in 64-entry blocks of a shuffled table, for B = 1), for B = 1 and 16 requests. The two
paths alternate ``--rounds`` times (A, B, A, B, …) and each keeps its best round of ``--calls`` calls (attention:
``--calls`` / (20 B), index scores ``--calls`` / 40, at least 5): on cores shared with other jobs single timings
swing several-fold. Prints a table, then one JSON line. No gradient (as in a decode step); one intra-op thread
unless ``--threads``.

    OMP_NUM_THREADS=1 python benchmarks/bench_layers.py
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

from kvdiet.cli import ArgumentParser
from kvdiet.formats import native
from kvdiet.formats.mxfp4 import encode_index_key, fake_quant_index_key
from kvdiet.model.attention import attend
from kvdiet.model.chain_products import batched_product, chain_class, chain_fits
from kvdiet.model.decode_attend import decode_attend
from kvdiet.model.index_scores import StoredKeys, index_scores
from kvdiet.model.layers import RMSNorm, Rope
from kvdiet.units import positive_int

Call = Callable[[], torch.Tensor]


def cases(batch: int) -> dict[str, tuple[Call, Call]]:
    """Name -> (the torch call, the compiled call), at ``batch`` decode rows (fixed seed); the norms and RoPE
    are one call on either path (``KVDIET_NATIVE_KERNELS`` picks)."""
    gen = torch.Generator().manual_seed(batch)
    out: dict[str, tuple[Call, Call]] = {}
    for dim in (128, 256, 512):
        norm, x = RMSNorm(dim, 1e-20), torch.randn(batch, dim, generator=gen)
        out[f"RMSNorm [{batch}, {dim}]"] = (lambda norm=norm, x=x: norm(x),) * 2
    rope = Rope(64, 10000.0, False, 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64)))
    rot = rope.at(torch.arange(4000, 4000 + batch))
    q = torch.randn(batch, 4, 512, generator=gen).transpose(0, 1)
    kv = torch.randn(batch, 512, generator=gen)
    out[f"RoPE q [4, {batch}, 512]"] = (lambda: rot.apply(q),) * 2
    out[f"RoPE q [4, {batch}, 512] inverse"] = (lambda: rot.apply(q, inverse=True),) * 2
    out[f"RoPE kv [{batch}, 512]"] = (lambda: rot.apply(kv),) * 2
    rows = torch.randn(batch, 4, 512, generator=gen)
    win, comp = torch.randn(batch, 128, 512, generator=gen), torch.randn(batch, 512, 512, generator=gen)
    win_mask, comp_mask = torch.ones(batch, 128, dtype=torch.bool), torch.ones(batch, 512, dtype=torch.bool)
    sink = torch.randn(4, generator=gen)
    for name, entries, mask in (("128+512 keys", comp, comp_mask), ("128 keys", None, None)):
        args = (rows, win, win_mask, entries, mask, sink, 512**-0.5)
        out[f"attention [{batch}, 4, 512] {name}"] = (
            lambda a=args: attend(*a),
            lambda a=args: decode_attend(*a),
        )
    if batch == 1:  # a decode row's scan of one layer's index keys (`KVDIET_NATIVE_KERNELS` picks the path)
        n, per_block = 16384, 64
        keys = StoredKeys(
            encode_index_key(torch.randn(n, 128, generator=gen)),
            torch.randperm(n // per_block, generator=gen),
            per_block,
            n,
        )
        q_idx = fake_quant_index_key(torch.randn(1, 4, 128, generator=gen))  # queries are MXFP4 round trips
        w, limit = torch.rand(1, 4, generator=gen), torch.tensor([n])
        out[f"index scores [1, 4, 128] x {n:,} keys"] = (lambda: index_scores(q_idx, w, keys, limit),) * 2
    return out


def prefill_cases(rows: int = 1024) -> dict[str, tuple[Call, Call]]:
    """Name -> (``torch.bmm``, `batched_product`) on a prefill chunk's operands of ``rows`` rows (fixed seed), in
    the layouts the model passes them (combᵀ a transposed view; the probabilities a slice of the window's and the
    selected entries')."""
    gen = torch.Generator().manual_seed(rows)
    operands = {}
    for hidden in (64, 256):
        comb_t = torch.rand(rows, 4, 4, generator=gen).transpose(1, 2)
        operands[f"mHC combᵀ·residual [{rows}, 4, 4]·[{rows}, 4, {hidden}]"] = (
            comb_t,
            torch.randn(rows, 4, hidden, generator=gen),
        )
    probs = torch.rand(rows, 4, 12, generator=gen)[..., :8]
    operands[f"probs·window [{rows}, 4, 8]·[{rows}, 8, 64]"] = (
        probs,
        torch.randn(rows, 8, 64, generator=gen),
    )
    out: dict[str, tuple[Call, Call]] = {}
    for name, (a, w) in operands.items():
        form = chain_fits(*chain_class(a, w)).name  # NONE: both rows time torch.bmm
        out[f"{name} ({form})"] = (lambda a=a, w=w: torch.bmm(a, w), lambda a=a, w=w: batched_product(a, w))
    return out


def round_us(call: Callable[[], torch.Tensor], calls: int) -> float:
    """Mean µs per call of ``calls`` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rounds", type=positive_int, default=7, help="A/B rounds per row, best kept (default 7)"
    )
    parser.add_argument(
        "--calls",
        type=positive_int,
        default=2000,
        help="calls per round (default 2000; attention rows --calls / (20 B), prefill products --calls / 20, "
        "at least 5)",
    )
    parser.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if native.fp4_kernels() is None:
        raise SystemExit("the compiled kernels did not build (or KVDIET_NATIVE_KERNELS=0)")
    results: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        for batch in (1, 16):
            for name, (torch_call, compiled_call) in cases(batch).items():
                best = {"compiled": float("inf"), "torch": float("inf")}
                calls = (
                    max(5, args.calls // (20 * batch))
                    if name.startswith("attention")
                    else max(5, args.calls // 40)
                    if name.startswith("index")
                    else args.calls
                )
                for _ in range(args.rounds):
                    for path, call in (("compiled", compiled_call), ("torch", torch_call)):
                        os.environ[native.ENV] = "1" if path == "compiled" else "0"
                        call()  # warm-up (and the once-per-process check)
                        best[path] = min(best[path], round_us(call, calls))
                os.environ.pop(native.ENV)
                results[name] = best
        for name, (torch_call, compiled_call) in prefill_cases().items():
            best = {"compiled": float("inf"), "torch": float("inf")}
            for _ in range(args.rounds):
                for path, call in (("compiled", compiled_call), ("torch", torch_call)):
                    call()  # warm-up (and the once-per-class check)
                    best[path] = min(best[path], round_us(call, max(5, args.calls // 20)))
            results[name] = best
    table = Table(
        title="per call, best round (µs)",
        caption="(CHAIN / SETTLED / FROM_NEGATIVE_ZERO / NONE): the form of chain_bmm its check found for that "
        "product on this machine (NONE: both columns time torch.bmm)",
    )
    for column in ("shape", "torch", "compiled", "speed-up"):
        table.add_column(column, justify="left" if column == "shape" else "right")
    for name, best in results.items():
        ratio = best["torch"] / best["compiled"]
        table.add_row(name, f"{best['torch']:.1f}", f"{best['compiled']:.1f}", f"{ratio:.1f}x")
    Console().print(table)
    print(
        json.dumps(
            {"threads": args.threads, "rounds": args.rounds, "calls": args.calls, "us_per_call": results}
        )
    )


if __name__ == "__main__":
    main()
