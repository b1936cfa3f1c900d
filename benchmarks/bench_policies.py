"""What each SWA policy stores, recomputes and changes, on one two-turn conversation (v4.1-mini by default).

Turn 1 (process A): a prompt of ``--tokens`` tokens and ``--output`` greedy tokens. Turn 2 (process B: a
fresh device pool and an empty SWA pool on the same persistent directory, as after a restart or on another
worker): turn 1's tokens plus a short follow-up. For each policy the script reports the bytes turn 1 left
in each tier, where turn 2's window state came from, the tokens it recomputed, its TTFT, and the largest
difference of turn 2's first logits from a cold run of the same tokens (0 for exact policies, up to
float rounding; the bounded-replay approximation otherwise). Decoder-side replay is off here, so "cold"
is the exact full prefill. Prints a table, then one JSON line.

    python benchmarks/bench_policies.py                     # ~5 min on 2 cores
    python benchmarks/bench_policies.py --model v4.1-micro --tokens 200 --block-size 4
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from kvdiet.cache.policies import parse_policy
from kvdiet.cli import ArgumentParser
from kvdiet.engine.runner import CacheOptions, ModelRunner
from kvdiet.model.build import load_model

SEED = 0
POLICIES = ("bounded-replay", "boundary-snapshot", "full-store", "checkpoint:256", "exact-recompute")


def run(cache: ModelRunner, ids: list[int], output: int) -> tuple[list[int], torch.Tensor, float]:
    """Prefill ``ids``, decode ``output`` greedy tokens; returns (all tokens fed, first logits, TTFT s)."""
    start = time.perf_counter()
    s = cache.start(ids)
    logits = cache.prefill(s, chunk_size=512)
    first, ttft = logits, time.perf_counter() - start
    fed = list(ids)
    for _ in range(output):
        token = int(torch.argmax(logits))
        logits = cache.decode([s], [token])[0]
        fed.append(token)
    cache.finish(s)
    return fed, first, ttft


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="v4.1-mini")
    parser.add_argument("--tokens", type=int, default=1024, help="turn-1 prompt tokens (default 1024)")
    parser.add_argument("--output", type=int, default=16, help="turn-1 output tokens (default 16)")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--policies", default=",".join(POLICIES))
    args = parser.parse_args()
    model, _ = load_model(args.model, seed=SEED)
    gen = torch.Generator().manual_seed(SEED)
    vocab = model.cfg.vocab_size
    prompt = torch.randint(2, min(vocab, 100_000), (args.tokens,), generator=gen).tolist()
    follow = torch.randint(2, min(vocab, 100_000), (8,), generator=gen).tolist()
    block_bytes = model.new_pool(1, block_size=args.block_size).block_bytes
    budget = (args.tokens + args.output + 64) // args.block_size * block_bytes * 3
    rows, cold_cache = [], None
    for name in args.policies.split(","):
        folder = Path(tempfile.mkdtemp(prefix="kvdiet-bench-policies-"))
        opts = CacheOptions(
            kv_cache_memory=budget,
            block_size=args.block_size,
            persistent_dir=folder,
            policy=parse_policy(name),
            decoder_replay=False,
        )
        with ModelRunner(model, opts) as a:
            fed, _, _ = run(a, prompt, args.output)
            stored = {"persistent": a.persistent.nbytes, "swa_pool": a.swa_pool.nbytes}
        turn2 = [*fed, *follow]
        with ModelRunner(model, opts) as b:
            _, logits, ttft = run(b, turn2, 0)
            prov = b.stats.replayed_tokens, b.stats.computed_tokens
        if cold_cache is None:
            cold_opts = CacheOptions(
                kv_cache_memory=budget, block_size=args.block_size, prefix_caching=False, decoder_replay=False
            )
            with ModelRunner(model, cold_opts) as c:
                _, cold_logits, cold_ttft = run(c, turn2, 0)
                cold_cache = (cold_logits, cold_ttft)
        drift = float((logits - cold_cache[0]).abs().max())
        rows.append(
            {
                "policy": name,
                "persistent_bytes": stored["persistent"],
                "swa_pool_bytes": stored["swa_pool"],
                "replayed_tokens": prov[0],
                "computed_tokens": prov[1],
                "ttft_seconds": round(ttft, 3),
                "ttft_over_cold": round(ttft / cold_cache[1], 4),
                "max_abs_logit_diff_vs_cold": drift,
            }
        )
    table = Table(
        title=f"SWA policies, turn 2 of a {args.tokens}+{args.output}+8-token conversation ({args.model})"
    )
    for col in rows[0]:
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in rows:
        table.add_row(
            *(
                f"{v:,}" if isinstance(v, int) else f"{v:.3g}" if isinstance(v, float) else v
                for v in r.values()
            )
        )
    Console(width=160).print(table)
    print(
        json.dumps(
            {
                "bench": "policies",
                "model": args.model,
                "cold_ttft_seconds": round(cold_cache[1], 3),
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
