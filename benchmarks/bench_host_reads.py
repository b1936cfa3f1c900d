"""Host reads of one v4.1-mini decode step on the path a GPU runs, counted on the CPU, by call site.

On a GPU each read of a tensor's value into Python (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``, a
``nonzero``) waits for the device to finish everything queued before it: a decode step with hundreds of them
cannot overlap its kernel launches, and none can be captured in a CUDA graph. This script counts them without a
GPU: it runs the pure-torch path (``KVDIET_NATIVE_KERNELS=0``, what runs off the CPU) under
`kvdiet.host_reads.HostReads`, which records every such call and the kvdiet line that made it. The step's
caches are filled as ``bench_decode.py`` fills them (random entries in the real packed formats). Prints a table,
then one JSON line. Deterministic (fixed seed); a few reads depend on the data (the top-k's tie paths), and a GPU
profile adds the CUDA-only paths (the Triton attention's).

    python benchmarks/bench_host_reads.py                  # one step at 4K context, a few seconds
    python benchmarks/bench_host_reads.py --context 64K --requests 4
"""

from __future__ import annotations

import os

os.environ["KVDIET_NATIVE_KERNELS"] = "0"  # before kvdiet loads: the pure-torch path is the GPU's

import argparse
import json

import torch
from rich.console import Console
from rich.table import Table

from bench_decode import SEED, fill_state
from kvdiet.cli import ArgumentParser
from kvdiet.host_reads import HostReads
from kvdiet.model.build import load_model
from kvdiet.units import positive_count, positive_int


def main() -> None:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument(
        "--context", type=positive_count, default=4096, help="tokens of context (default 4Ki)"
    )
    parser.add_argument("--requests", type=positive_int, default=1, help="requests in the step (default 1)")
    parser.add_argument("--top", type=positive_int, default=15, help="call sites shown (default 15)")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    torch.manual_seed(SEED)
    model, _ = load_model("v4.1-mini", seed=SEED, device="cpu")
    if args.context + 2 > model.cfg.max_position_embeddings:
        parser.error(
            f"--context must leave room for two steps in {model.cfg.max_position_embeddings:,} positions"
        )
    gen = torch.Generator().manual_seed(SEED)
    pool = model.new_pool(args.requests * -(-(args.context + 64) // 64))
    states = [fill_state(model, args.context, gen, pool) for _ in range(args.requests)]
    tokens = [5] * args.requests
    with torch.no_grad():
        model.decode(states, tokens)  # warm-up: one-time checks and caches
        with HostReads() as reads:
            model.decode(states, tokens)
    total = reads.total
    result = {
        "bench": "host_reads",
        "model": "v4.1-mini",
        "context": args.context,
        "requests": args.requests,
        "host_reads_per_step": total,
        "sites": [{"kind": k, "where": w, "count": n} for (k, w), n in reads.sites.most_common()],
    }
    if not args.json_only:
        table = Table(title=f"host reads of one decode step: {total}")
        for name in ("reads", "kind", "where"):
            table.add_column(name, justify="right" if name == "reads" else "left")
        for (kind, where), n in reads.sites.most_common(args.top):
            table.add_row(str(n), kind, where)
        Console().print(table)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
