"""Time to first token of a repeated long prompt on v4.1-mini, by where its cache comes from; tier bandwidth.

One run, one prompt (default 32K tokens of real text through the DeepSeek tokenizer, fixed seed):

- cold: nothing cached (the baseline of every ratio);
- device hit: the same process asks again (global KV blocks in the device pool, window snapshot in the
  SWA pool);
- persistent hit + SWA pool hit: a fresh device pool (as after an eviction or on another worker) sharing
  the SWA pool: global KV loaded from the persistent tier, window state restored exactly;
- persistent hit + bounded replay: a fresh device pool and an empty SWA pool (the pool TTL passed): global
  KV loaded, the last W tokens replayed.

Each TTFT covers lookup, loads, restore or replay, the remaining prefill and sampling the first token.
Then the persistent tier's write and read throughput (GB/s) for the prompt's blocks, next to a plain
sequential write (with fsync) and read of the same bytes in one file on the same disk. Prints a table,
then one JSON line.

    python benchmarks/bench_prefix.py                  # 32K tokens; the cold prefill takes ~3 min on 2 cores
    python benchmarks/bench_prefix.py --tokens 4K      # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from kvdiet.cli import ArgumentParser
from kvdiet.engine.runner import CacheOptions, ModelRunner
from kvdiet.engine.sampling import SamplingParams, sample
from kvdiet.model.build import load_model
from kvdiet.storage.swa_pool import InProcessSwaPool
from kvdiet.units import parse_count

SEED = 0


def prompt_ids(tokenizer, n: int) -> list[int]:
    """``n`` token ids of real Python source (the standard library's ``typing.py``, repeated), BOS first."""
    import typing

    text = Path(typing.__file__).read_text()
    ids = [tokenizer.bos_token_id]
    while len(ids) < n:
        ids += tokenizer.encode(text)
    return ids[:n]


def ttft(cache: ModelRunner, ids: list[int], chunk: int) -> tuple[float, dict, torch.Tensor]:
    """Seconds from request start to the first sampled token; the provenance; the first-token logits."""
    start = time.perf_counter()
    session = cache.start(ids)
    logits = cache.prefill(session, chunk_size=chunk)
    sample(logits, SamplingParams(max_tokens=1), torch.Generator().manual_seed(SEED))
    seconds = time.perf_counter() - start
    cache.finish(session)
    return seconds, session.provenance.as_dict(), logits


def file_throughput(payloads: list[bytes], folder: Path) -> tuple[float, float]:
    """Plain sequential write (+fsync) and read of the same bytes as one file: (write GB/s, read GB/s)."""
    path = folder / "plain.bin"
    total = sum(len(p) for p in payloads)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for p in payloads:
            f.write(p)
        f.flush()
        os.fsync(f.fileno())
    write = total / (time.perf_counter() - start) / 1e9
    start = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass
    read = total / (time.perf_counter() - start) / 1e9
    return write, read


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="32Ki", help="prompt length (default 32Ki = 32,768)")
    parser.add_argument("--chunk-size", type=int, default=512, help="prefill chunk (default 512)")
    parser.add_argument("--dir", help="persistent-tier directory (default: a temporary one)")
    args = parser.parse_args()
    torch.manual_seed(SEED)
    console = Console(stderr=True)
    model, tokenizer = load_model("v4.1-mini", seed=SEED)
    ids = prompt_ids(tokenizer, parse_count(args.tokens))
    folder = Path(args.dir or tempfile.mkdtemp(prefix="kvdiet-bench-prefix-"))
    budget = (len(ids) // 64 + 8) * model.new_pool(1).block_bytes
    pool = InProcessSwaPool(1 << 30)

    def cache(swa: InProcessSwaPool) -> ModelRunner:
        opts = CacheOptions(kv_cache_memory=budget, persistent_dir=folder)
        return ModelRunner(model, opts, tokenizer_id=tokenizer.identity, swa_pool=swa).open()

    rows: dict[str, tuple[float, dict]] = {}
    first = cache(pool)
    console.print(f"cold prefill of {len(ids):,} tokens …")
    cold_s, prov, cold_logits = ttft(first, ids, args.chunk_size)
    rows["cold"] = (cold_s, prov)
    s, prov, _ = ttft(first, ids, args.chunk_size)
    rows["device hit"] = (s, prov)
    # persistent-tier bandwidth on the blocks the cold run wrote (before another cache touches them)
    store = first.persistent
    blocks = [first.pool.read_block(b) for b in range(len(ids) // 64)]
    keys = [os.urandom(32) for _ in blocks]
    toks = [ids[i * 64 : (i + 1) * 64] for i in range(len(blocks))]
    start = time.perf_counter()
    for k, t, p in zip(keys, toks, blocks, strict=True):
        store.put(k, t, p)
    put_gbs = sum(map(len, blocks)) / (time.perf_counter() - start) / 1e9
    start = time.perf_counter()
    got = [store.get(k, t) for k, t in zip(keys, toks, strict=True)]
    get_gbs = sum(map(len, blocks)) / (time.perf_counter() - start) / 1e9
    assert got == blocks, "persistent tier returned other bytes"
    plain_w, plain_r = file_throughput(blocks, folder)
    first.close()

    second = cache(pool)  # fresh device pool, same SWA pool
    s, prov, _ = ttft(second, ids, args.chunk_size)
    rows["persistent hit + SWA pool hit"] = (s, prov)
    second.close()
    third = cache(InProcessSwaPool(1 << 30))  # fresh device pool, empty SWA pool
    s, prov, replay_logits = ttft(third, ids, args.chunk_size)
    rows["persistent hit + bounded replay"] = (s, prov)
    third.close()
    drift = float((replay_logits - cold_logits).abs().max())

    table = Table(title=f"TTFT of a repeated {len(ids):,}-token prompt (v4.1-mini, block 64, W=128)")
    for col in ("path", "TTFT s", "× cold", "device", "persistent", "window from", "replayed", "computed"):
        table.add_column(col, justify="left" if col in ("path", "window from") else "right")
    for name, (sec, p) in rows.items():
        table.add_row(
            name,
            f"{sec:.3f}",
            f"{sec / cold_s:.4f}",
            f"{p['device_tokens']:,}",
            f"{p['persistent_tokens']:,}",
            p["window_source"],
            f"{p['replayed_tokens']:,}",
            f"{p['computed_tokens']:,}",
        )
    Console(width=150).print(table)
    bw = Table(
        title=f"persistent tier vs a plain file, {sum(map(len, blocks)) / 1e6:.1f} MB in {len(blocks)} blocks"
    )
    for col in ("", "write GB/s", "read GB/s"):
        bw.add_column(col, justify="right")
    bw.add_row("persistent tier (put/get)", f"{put_gbs:.3f}", f"{get_gbs:.3f}")
    bw.add_row("plain sequential file", f"{plain_w:.3f}", f"{plain_r:.3f}")
    bw.add_row("tier / file", f"{put_gbs / plain_w:.2f}", f"{get_gbs / plain_r:.2f}")
    Console(width=150).print(bw)
    result = {
        "bench": "prefix",
        "prompt_tokens": len(ids),
        "ttft_seconds": {k: round(v[0], 4) for k, v in rows.items()},
        "ttft_over_cold": {k: round(v[0] / cold_s, 5) for k, v in rows.items()},
        "replayed_tokens": rows["persistent hit + bounded replay"][1]["replayed_tokens"],
        "bounded_replay_max_abs_logit_drift": round(drift, 5),
        "persistent_put_gb_per_s": round(put_gbs, 3),
        "persistent_get_gb_per_s": round(get_gbs, 3),
        "plain_file_write_gb_per_s": round(plain_w, 3),
        "plain_file_read_gb_per_s": round(plain_r, 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
