"""What running the released DeepSeek-V4.1-Flash checkpoint costs on a CPU machine, from measured parts.

1. **Bytes** (from the real config, no checkpoint needed): the released storage of every tensor
   (`kvdiet.model.export` rules) → checkpoint bytes on disk, what stays resident under fp8 numerics (FP8/FP4
   weights as their bytes, the rest fp32; Engram tables read row by row), and the routed-expert total.
2. **Per-layer decode time**: each linear of one V4.1-Flash layer at its real shape (FP8 with FP8
   activations, routed experts FP4), one token, best of ``--repeats``; a layer = its attention linears + 6
   routed experts + the shared expert (+ indexer/compressor where the layer has them); the model = the 40
   layers' sum + the LM head. Attention over the cache itself is left out (small at short context).
3. **Expert reads**: one routed expert (3 FP4 matrices with scales, 17.9 MB) read from a file with
   kvdiet's positioned reads, warm page cache, vs ``cp``-style sequential read of the same bytes.
4. **A checkpoint larger than memory**: `write_random_checkpoint` of a widened v4.1-micro (2.2 GB) run by
   ``kvdiet generate`` with a 32 MB expert cache in a child process: peak RSS vs checkpoint bytes.

Table, then one JSON line. Fixed seed; honours ``--threads``.

    python benchmarks/bench_checkpoint.py
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from kvdiet.cli import ArgumentParser
from kvdiet.config import load_config
from kvdiet.layer_plan import LayerPlan
from kvdiet.model.export import write_random_checkpoint
from kvdiet.model.linear import Linear, quantize_fp4_weight, quantize_fp8_weight

SEED = 0
GB = 1e9


def fp8(o: int, i: int) -> int:
    """Bytes of an [o, i] FP8 weight: E4M3 values + one UE8M0 scale per 32×32 tile."""
    return o * i + (-(-o // 32)) * (-(-i // 32))


def fp4(o: int, i: int) -> int:
    """Bytes of an [o, i] FP4 weight: E2M1 nibbles + one UE8M0 scale per 32 inputs."""
    return o * i // 2 + o * i // 32


def released_bytes(cfg) -> dict[str, float]:
    """Checkpoint, resident (fp8 numerics) and routed-expert bytes of ``cfg`` by the release's storage."""
    h, n = cfg.hidden_size, cfg.num_hidden_layers
    plan = LayerPlan.from_config(cfg)
    attn = fp8(cfg.q_lora_rank, h) + fp8(cfg.num_attention_heads * cfg.head_dim, cfg.q_lora_rank)
    attn += fp8(cfg.head_dim, h) + fp8(h, cfg.o_groups * cfg.o_lora_rank)
    wo_a = cfg.num_attention_heads * cfg.head_dim * cfg.o_lora_rank  # bf16 on disk, fp32 resident
    shared = 3 * fp8(cfg.moe_intermediate_size * cfg.n_shared_experts, h)
    gate = cfg.n_routed_experts * h
    extra_fp8, extra_dense = 0, 0
    for info in plan.layers:
        if info.owns_indexer:
            extra_fp8 += fp8(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
            extra_dense += cfg.index_n_heads * h
        if info.owns_index_keys:
            extra_dense += cfg.index_head_dim * cfg.head_dim
        if info.owns_compressed_kv:
            extra_dense += (2 if info.compress_ratio > 1 else 1) * cfg.head_dim * h
    experts = n * cfg.n_routed_experts * 3 * fp4(cfg.moe_intermediate_size, h)
    dense = n * (wo_a + gate) + extra_dense + 2 * cfg.vocab_size * h  # + embed, head
    engram_rows = sum(cfg.engram_num_embeddings or ()) * (cfg.engram_head_dim or 0)
    engram = engram_rows * 33 // 32
    engram_wkv = len(cfg.engram_layer_ids or ()) * fp8(
        h * (cfg.hc_mult + 1), (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim
    )
    quantised = n * (attn + shared) + extra_fp8 + engram_wkv
    return {
        "checkpoint_gb": (quantised + 2 * dense + experts + engram) / GB,
        "routed_experts_gb": experts / GB,
        "engram_tables_gb": engram / GB,
        "resident_fp8_gb": (quantised + 4 * dense) / GB,
        "one_token_experts_gb": n * cfg.num_experts_per_tok * 3 * fp4(cfg.moe_intermediate_size, h) / GB,
    }


def time_linear(out_f: int, in_f: int, storage: str, rows: int, repeats: int) -> float:
    """Best seconds of one forward of an [out, in] linear on ``rows`` input rows."""
    gen = torch.Generator().manual_seed(SEED)
    w = torch.randn(out_f, in_f, generator=gen) * 0.02
    lin = Linear(in_f, out_f)
    if storage == "fp8":
        lin.set_weight(*quantize_fp8_weight(w, block=32), block=32)
    elif storage == "fp4":
        lin.set_weight(*quantize_fp4_weight(w))
    else:
        lin.set_weight(w)
    del w
    x = torch.randn(rows, in_f, generator=gen)
    lin(x)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        lin(x)
        best = min(best, time.perf_counter() - t)
    return best


def layer_seconds(cfg, repeats: int) -> dict[str, float]:
    h = cfg.hidden_size
    inter = cfg.moe_intermediate_size
    part = {
        "wq_a (fp8)": time_linear(cfg.q_lora_rank, h, "fp8", 1, repeats),
        "wq_b (fp8)": time_linear(cfg.num_attention_heads * cfg.head_dim, cfg.q_lora_rank, "fp8", 1, repeats),
        "wkv (fp8)": time_linear(cfg.head_dim, h, "fp8", 1, repeats),
        "wo_a (fp32, grouped)": time_linear(
            cfg.o_groups * cfg.o_lora_rank,
            cfg.num_attention_heads * cfg.head_dim // cfg.o_groups,
            "dense",
            1,
            repeats,
        )
        / cfg.o_groups,
        "wo_b (fp8)": time_linear(h, cfg.o_groups * cfg.o_lora_rank, "fp8", 1, repeats),
        "routed expert w1+w3+w2 (fp4)": 2 * time_linear(inter, h, "fp4", 1, repeats)
        + time_linear(h, inter, "fp4", 1, repeats),
        "shared expert (fp8)": 2 * time_linear(inter, h, "fp8", 1, repeats)
        + time_linear(h, inter, "fp8", 1, repeats),
        "indexer wq_b (fp8)": time_linear(
            cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, "fp8", 1, repeats
        ),
    }
    return part


def expert_read_seconds(cfg, repeats: int) -> tuple[float, int]:
    from safetensors.torch import save_file

    from kvdiet.model.checkpoint import Checkpoint

    gen = torch.Generator().manual_seed(SEED)
    tensors = {}
    for name, (o, i) in {
        "w1": (cfg.moe_intermediate_size, cfg.hidden_size),
        "w3": (cfg.moe_intermediate_size, cfg.hidden_size),
        "w2": (cfg.hidden_size, cfg.moe_intermediate_size),
    }.items():
        q, s = quantize_fp4_weight(torch.randn(o, i, generator=gen))
        tensors[f"layers.0.ffn.experts.0.{name}.weight"], tensors[f"layers.0.ffn.experts.0.{name}.scale"] = (
            q,
            s,
        )
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "model.safetensors"
        save_file(tensors, str(path))
        ckpt = Checkpoint.open(path)
        nbytes = ckpt.nbytes
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            for name in ckpt.tensors:
                ckpt.read(name)
            best = min(best, time.perf_counter() - t)
    return best, nbytes


def larger_than_memory() -> dict[str, float]:
    cfg = load_config("v4.1-micro").replace(hidden_size=256, moe_intermediate_size=1536, n_routed_experts=384)
    with tempfile.TemporaryDirectory() as d:
        write_random_checkpoint(cfg, d, seed=SEED, shard_bytes=256 << 20)
        ids = ",".join(str(3 + i % 60) for i in range(32))
        t = time.perf_counter()
        run = subprocess.run(
            [sys.executable, "-m", "kvdiet.cli", "generate", "--weights", d, "--prompt-ids", ids, "--max-tokens", "4",
             "--expert-cache-size", "32MB", "--kv-cache-memory", "16MB", "--persistent-dir", "none", "--json"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        wall = time.perf_counter() - t
    out = json.loads(run.stdout)
    return {
        "checkpoint_gb": out["checkpoint_bytes"] / GB,
        "peak_rss_gb": out["peak_rss_bytes"] / GB,
        "expert_bytes_read_gb": out["expert_cache"]["bytes_read"] / GB,
        "generate_wall_s": wall,
    }


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--skip-large", action="store_true", help="skip the 2.2 GB larger-than-memory run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config("deepseek-v4.1-flash")
    sizes = released_bytes(cfg)
    parts = layer_seconds(cfg, args.repeats)
    read_s, expert_bytes = expert_read_seconds(cfg, args.repeats)
    k = cfg.num_experts_per_tok
    plan = LayerPlan.from_config(cfg)
    indexers = sum(1 for i in plan.layers if i.owns_indexer)
    attn = sum(v for key, v in parts.items() if key.startswith(("wq_", "wkv", "wo_")))
    layer = attn + k * parts["routed expert w1+w3+w2 (fp4)"] + parts["shared expert (fp8)"]
    head = time_linear(cfg.vocab_size, cfg.hidden_size, "dense", 1, args.repeats)
    token = cfg.num_hidden_layers * layer + indexers * parts["indexer wq_b (fp8)"] + head
    cold_reads = cfg.num_hidden_layers * k * read_s  # every chosen expert read (page cache warm)
    console = Console()
    table = Table(title=f"DeepSeek-V4.1-Flash on this CPU ({args.threads} threads), decode of one token")
    table.add_column("part")
    table.add_column("value", justify="right")
    for key, v in sizes.items():
        table.add_row(key.replace("_gb", "").replace("_", " "), f"{v:,.1f} GB")
    for key, v in parts.items():
        table.add_row(key, f"{v * 1e3:,.1f} ms")
    table.add_row("one layer (attention linears + 6 routed + shared)", f"{layer:,.2f} s")
    table.add_row("LM head (fp32)", f"{head * 1e3:,.1f} ms")
    table.add_row("one token, all 40 layers (experts cached)", f"{token:,.1f} s")
    table.add_row(f"expert read ({expert_bytes / 1e6:.1f} MB, warm page cache)", f"{read_s * 1e3:,.1f} ms")
    table.add_row("one token, every expert read from the page cache", f"{token + cold_reads:,.1f} s")
    result = {
        "bench": "checkpoint",
        "threads": args.threads,
        **{k2: round(v, 2) for k2, v in sizes.items()},
        "layer_s": round(layer, 3),
        "token_s_cached": round(token, 2),
        "token_s_reads": round(token + cold_reads, 2),
        "expert_read_ms": round(read_s * 1e3, 2),
        "expert_bytes": expert_bytes,
    }
    if not args.skip_large:
        large = larger_than_memory()
        table.add_row("larger than memory: checkpoint", f"{large['checkpoint_gb']:,.2f} GB")
        table.add_row(
            "  peak RSS of `kvdiet generate` (32 MB expert cache)", f"{large['peak_rss_gb']:,.2f} GB"
        )
        table.add_row("  expert bytes read", f"{large['expert_bytes_read_gb']:,.2f} GB")
        table.add_row("  wall time (32 prompt + 4 output tokens)", f"{large['generate_wall_s']:,.1f} s")
        result.update({f"large_{k2}": round(v, 3) for k2, v in large.items()})
    console.print(table)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
