"""Decode step latency of v4.1-mini from 4K to 1M tokens of context, and prefill throughput vs chunk size.

Caches are filled directly (random entries encoded in the real packed formats, tiled to the context
length) rather than by prefill, so a 1M-token context is ready in seconds. For each context the script
times decode steps (warm-up excluded, median of --steps), then, in as many more steps each, splits a step by
layer role (attention of swa-only / full / reindex / reuse layers, and the MoE FFNs) and into the compiled kernels
and the rest (Python and torch's ops between them: "in kernels"), and sets the bytes one step must read against
this machine's measured read bandwidth (the floor a bandwidth-bound step could reach; the best of a measurement
before the first context and one after each, so a neighbour's load at one moment does not lower the floor): the
packed cache bytes (KV floor), and those plus the weights a one-request step reads (step floor: at short contexts
the weights dominate).
Then it prefills one prompt at several chunk sizes, and measures how far decoder-side replay moves the last
position's logits against a full prefill. Prints tables, then one JSON line.

    python benchmarks/bench_decode.py                 # 4K, 32K, 128K, 512K, 1M; ~5 min on 2 cores
    python benchmarks/bench_decode.py --contexts 4K,32K --prefill-tokens 1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

from kvdiet.cli import ArgumentParser
from kvdiet.device import add_device_arg, check_device, machine_name, seconds
from kvdiet.formats import native
from kvdiet.model.build import load_model
from kvdiet.model.paged_pool import DevicePool
from kvdiet.model.state import RequestState
from kvdiet.model.transformer import Transformer
from kvdiet.units import count_list, positive_count, positive_int

SEED = 0


def read_bandwidth(num_bytes: int = 1 << 30, device: str = "cpu") -> float:
    """Bytes per second ``device`` reads: a sum over a 1 GiB fp32 tensor written beforehand, best of 3.

    A decode step only reads its caches and weights, so its floor is set by read bandwidth. (A copy into a
    new tensor is no measure of it: on the CPU its page faults dominate, 5-10x below the read rate.)"""
    x = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).uniform_()
    x.sum()
    return num_bytes / min(seconds(x.sum, device) for _ in range(3))


def fill_state(
    model: Transformer, context: int, gen: torch.Generator, pool: DevicePool | None = None
) -> RequestState:
    """A request state as if ``context`` tokens had been processed (random entries, real formats), on ``pool``
    (a batch's shared one) or a pool of its own."""
    cfg, codecs = model.cfg, model.codecs
    state = model.new_state(pool if pool is not None else model.new_pool(-(-(context + 64) // 64)))
    state.table.reserve(context + 64)  # the decode steps too: the model itself allocates nothing
    block = 4096
    for layer in model.plan.kv_sources:
        n = context // model.plan[layer].compress_ratio
        for store, codec in ((state.main[layer], codecs.main), (state.index_keys[layer], codecs.index_key)):
            rows = codec.encode(torch.randn(block, codec.dim, generator=gen))
            reps = -(-n // block)
            store.write_rows(rows.repeat(reps, 1)[:n])
    w, dev = cfg.sliding_window, model.device  # drawn on the host (same values on every device), then moved
    positions = torch.arange(max(0, context - w), context)
    for ring in state.windows:
        ring.write(torch.randn(positions.numel(), cfg.head_dim, generator=gen).to(dev), positions.to(dev))
    for layer, tail in state.tails.items():
        held = context % model.plan[layer].compress_ratio
        tail.replace(
            torch.randn(held, cfg.head_dim, generator=gen).to(dev),
            torch.randn(held, cfg.head_dim, generator=gen).to(dev),
        )
    if model.hasher is not None:
        state.engram_history = torch.randint(
            0, model.hasher.compressed_vocab_size, (model.hasher.history_len,)
        ).to(dev)
    state.num_tokens = context
    return state


def step_bytes(model: Transformer, context: int) -> int:
    """Distinct packed cache bytes one decode step reads: each index source's keys (the candidate consumers
    only their shared pool of ``candidate_topk_blocks × candidate_block_size`` entries, counted once: each
    consumer reads it again), the top-k main entries once per (KV source, top-k source) pair (the Reuse layers
    sharing a pair read the same entries), every layer's window ring. A lower bound: a floor."""
    cfg, plan, codecs = model.cfg, model.plan, model.codecs
    pool = cfg.candidate_topk_blocks * cfg.candidate_block_size
    total, pairs, pools = 0, set(), set()
    for info in plan.layers:
        ratio = info.compress_ratio
        entries = context // ratio if ratio else 0
        if info.owns_indexer and info.candidate != "consumer":
            total += entries * codecs.index_key.bytes_per_entry
        elif info.owns_indexer and info.kv_src not in pools:
            pools.add(info.kv_src)
            total += min(entries, pool) * codecs.index_key.bytes_per_entry
        if ratio and (info.kv_src, info.idx_src) not in pairs:
            pairs.add((info.kv_src, info.idx_src))
            total += min(cfg.index_topk, entries) * codecs.main.bytes_per_entry
        total += min(context, cfg.sliding_window) * codecs.window.bytes_per_entry
    return total


def weight_bytes(model: Transformer) -> int:
    """Weight bytes one request's decode step reads: every parameter, but one row of the token embedding and
    ``num_experts_per_tok / n_routed_experts`` of the routed experts (the token's experts; all are one size).
    Engram tables are buffers of which a step reads a few rows: not counted."""
    cfg = model.cfg
    total = 0.0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if name == "embed.weight":
            nbytes = p.shape[-1] * p.element_size()
        elif ".ffn.experts." in name:
            nbytes *= cfg.num_experts_per_tok / cfg.n_routed_experts
        total += nbytes
    return int(total)


def time_decode(model: Transformer, state: RequestState, steps: int) -> tuple[float, dict[str, float]]:
    """Median step seconds, then mean seconds per layer role (attention by role, ``moe`` for the FFNs) in as
    many more steps timed by forward hooks. The step's own time is taken without hooks: a hooked MoE takes its
    module path (`kvdiet.model.decode_ffn`), so the roles' split is of a slightly slower step."""
    model.decode([state], [5])  # warm-up
    times = [seconds(lambda: model.decode([state], [5]), model.device) for _ in range(steps)]
    spent: dict[str, float] = defaultdict(float)
    starts: dict[int, float] = {}

    def before(module: torch.nn.Module, _args: object) -> None:
        starts[id(module)] = time.perf_counter()

    def after(label: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, _args: object, _out: object) -> None:
            spent[label] += time.perf_counter() - starts[id(module)]

        return hook

    hooks = []
    for block in model.layers:
        for module, label in ((block.attn, f"attn:{block.info.role.value}"), (block.ffn, "moe")):
            hooks.append(module.register_forward_pre_hook(before))
            hooks.append(module.register_forward_hook(after(label)))
    try:
        for _ in range(steps):
            seconds(lambda: model.decode([state], [5]), model.device)
    finally:
        for h in hooks:
            h.remove()
    return statistics.median(times), {k: v / steps for k, v in sorted(spent.items())}


class _TimedKernels:
    """The compiled kernels module with every call's wall time added to ``seconds`` (about a microsecond more a
    call: the split it gives is a close estimate, the step it runs a little slower than an untimed one)."""

    def __init__(self, module: object) -> None:
        self._module, self.seconds = module, 0.0

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._module, name)
        if not callable(attr):
            return attr

        def timed(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def kernel_split(model: Transformer, state: RequestState, steps: int) -> tuple[float, float] | None:
    """Mean seconds per decode step spent inside the compiled kernels (`kvdiet.formats.native.fp4_kernels`), and
    the mean step in the same ``steps`` timed steps; the rest of a step is Python and torch's own ops between
    the kernels. None where the step runs no compiled kernels (the pure-torch path, a GPU)."""
    original = native.fp4_kernels
    module = original()
    if module is None or model.device.type != "cpu":
        return None
    proxy = _TimedKernels(module)
    native.fp4_kernels = lambda: proxy  # every caller asks native.fp4_kernels() at the call
    try:
        model.decode([state], [5])  # warm-up
        proxy.seconds = 0.0
        start = time.perf_counter()
        for _ in range(steps):
            model.decode([state], [5])
        step = (time.perf_counter() - start) / steps
    finally:
        native.fp4_kernels = original
    return proxy.seconds / steps, step


def time_prefill(model: Transformer, tokens: torch.Tensor, chunk: int) -> float:
    """Prefill tokens per second of ``tokens`` in chunks of ``chunk``."""
    state = model.new_state()
    chunks = tokens.split(chunk)
    return tokens.numel() / seconds(lambda: [model.prefill(state, c) for c in chunks], model.device)


def replay_drift(model: Transformer, tokens: torch.Tensor, chunk: int) -> float:
    """Max |Δ| of the last position's logits between decoder-side-replay prefill and full prefill (v41-spec §7.1)."""
    logits = []
    for decoder_replay in (True, False):
        state = model.new_state()
        for s in range(0, tokens.numel(), chunk):
            last = model.prefill(state, tokens[s : s + chunk], decoder_replay=decoder_replay)
        logits.append(last)
    return (logits[0] - logits[1]).abs().max().item()


def main() -> None:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument(
        "--contexts", type=count_list, default="4Ki,32Ki,128Ki,512Ki,1Mi", help="decode contexts (tokens)"
    )
    parser.add_argument("--steps", type=positive_int, default=3, help="timed decode steps per context")
    parser.add_argument(
        "--prefill-tokens", type=positive_count, default=1024, help="prompt length of the prefill sweep"
    )
    parser.add_argument(
        "--chunks",
        type=count_list,
        default="128,512,1024",
        help="prefill chunk sizes (one past --prefill-tokens runs, and is reported, as the whole prompt)",
    )
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    add_device_arg(parser)
    args = parser.parse_args()
    try:
        check_device(args.device)
    except ValueError as exc:
        parser.error(str(exc))
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    model, _ = load_model("v4.1-mini", seed=SEED, device=args.device)
    top = model.cfg.max_position_embeddings
    if max(args.contexts) > top or args.prefill_tokens > top:
        parser.error(f"contexts and --prefill-tokens must be at most the model's {top:,} positions")
    # the machine's read rate, best of the measurements taken before and after each context's steps: one taken
    # while a neighbour loads the memory bus would lower the floor and flatter every ratio
    bandwidths = [read_bandwidth(device=args.device)]
    weights = weight_bytes(model)
    rows = []
    room = model.cfg.max_position_embeddings - (3 * args.steps + 2)  # every step below must still fit
    for context in (min(c, room) for c in args.contexts):
        state = fill_state(model, context, gen)
        step_s, roles = time_decode(model, state, args.steps)
        split = kernel_split(model, state, args.steps)
        rows.append({"context": context, "step_seconds": step_s, "roles": roles,
                     "kv_bytes_read": step_bytes(model, context), "weight_bytes_read": weights,
                     "global_bytes": state.cache_bytes().global_bytes,
                     "kernel_seconds": None if split is None else split[0],
                     "timed_step_seconds": None if split is None else split[1]})  # fmt: skip
        del state
        bandwidths.append(read_bandwidth(device=args.device))
    bandwidth = max(bandwidths)
    for r in rows:
        r["kv_floor_seconds"] = r["kv_bytes_read"] / bandwidth
        r["floor_seconds"] = (r["kv_bytes_read"] + weights) / bandwidth
    prompt = torch.randint(0, model.cfg.vocab_size, (args.prefill_tokens,), generator=gen)
    # a chunk past the prompt is the whole prompt at once: timed (and labelled) as that
    chunks = sorted({min(c, args.prefill_tokens) for c in args.chunks})
    prefill = {c: time_prefill(model, prompt, c) for c in chunks}
    drift = replay_drift(model, prompt, 512)
    result = {
        "bench": "decode",
        "model": "v4.1-mini",
        "device": args.device,
        "machine": machine_name(args.device),
        "read_gb_per_s": bandwidth / 1e9,
        "read_gb_per_s_each": [b / 1e9 for b in bandwidths],
        "decode": rows,
        "growth_1m_over_4k": rows[-1]["step_seconds"] / rows[0]["step_seconds"] if len(rows) > 1 else None,
        "prefill_tokens": prompt.numel(),
        "prefill_tokens_per_second": prefill,
        "decoder_replay_max_abs_logit_drift": drift,
    }
    if not args.json_only:
        console = Console(width=170)
        table = Table(
            title=f"v4.1-mini decode step on {result['machine']} (read bandwidth {bandwidth / 1e9:.1f} GB/s)"
        )
        for col in (
            "context",
            "global KV",
            "step ms",
            "KV read",
            "weights read",
            "floor ms",
            "step/floor",
            "step/KV floor",
            "in kernels",
            "slowest roles (ms)",
        ):
            table.add_column(col, justify="right")
        for r in rows:
            top = sorted(r["roles"].items(), key=lambda kv: -kv[1])[:3]
            table.add_row(f"{r['context']:,}", f"{r['global_bytes'] / 1e6:,.1f} MB", f"{r['step_seconds'] * 1e3:,.0f}",
                          f"{r['kv_bytes_read'] / 1e6:,.1f} MB", f"{r['weight_bytes_read'] / 1e6:,.1f} MB",
                          f"{r['floor_seconds'] * 1e3:,.2f}", f"{r['step_seconds'] / r['floor_seconds']:,.1f}×",
                          f"{r['step_seconds'] / r['kv_floor_seconds']:,.1f}×",
                          "—" if r["kernel_seconds"] is None else
                          f"{r['kernel_seconds'] * 1e3:,.0f} ms ({r['kernel_seconds'] / r['timed_step_seconds']:.0%})",
                          ", ".join(f"{k} {v * 1e3:.0f}" for k, v in top))  # fmt: skip
        console.print(table)
        pt = Table(title=f"prefill of {prompt.numel():,} tokens (decoder-side replay on)")
        pt.add_column("chunk", justify="right")
        pt.add_column("tokens/s", justify="right")
        for c, v in prefill.items():
            pt.add_row(str(c), f"{v:,.1f}")
        console.print(pt)
        console.print(f"decoder-side replay vs full prefill, last-position logits: max |Δ| = {drift:.4g}")
        if prompt.numel() <= model.cfg.sliding_window:
            console.print(f"  (the {prompt.numel()}-token prompt fits in the {model.cfg.sliding_window}-token window: "
                          "replay keeps every row, so the drift is 0 by construction)")  # fmt: skip
        if result["growth_1m_over_4k"]:
            console.print(f"step time growth {rows[-1]['context']:,} / {rows[0]['context']:,}: "
                          f"{result['growth_1m_over_4k']:.2f}×")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
