"""Prefill and decode of the released 40-layer plan at tiny widths: the figures to set beside DeepSeek's reference.

The model is ``../shared/golden/bench-40layer-tiny/config.json`` (hidden 64, 4 heads × 64, window 8, index
top-4, Engram on layers 1 and 14) with seeded random weights, fp32, on the CPU. For each prompt length (256,
1,024 and 2,048 tokens by default) it times, best of ``--repeats`` after a warm-up:

- the **full prefill** — one chunk, every layer on every row (``decoder_replay=False``): the same work as
  the reference's prefill;
- the **bounded-replay prefill** — kvdiet's default, the decoder layers on the last W rows only — and its
  speed-up over the full one;
- the **decode step** after that prefill (median of ``--steps`` greedy steps).

Then **batch scaling**: one decode step for 1, 4 and 16 requests at once (each after its own prefill of
``--batch-context`` tokens, their caches in one pool as an engine's are), as tokens per second and × the single
request's; the sizes take turns step by step, so a shared machine's swings meet them alike. Deterministic (fixed
seed); ``--threads`` sizes torch's pool. Prints tables, then one JSON line.

    python benchmarks/bench_prefill.py                   # ~3 min on 2 cores
    python benchmarks/bench_prefill.py --tokens 256,1024 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from kvdiet.cli import ArgumentParser
from kvdiet.config import ConfigError, load_config
from kvdiet.device import add_device_arg, check_device, machine_name, seconds
from kvdiet.model.placement import place
from kvdiet.model.transformer import Transformer
from kvdiet.threads import check_threads, set_threads
from kvdiet.units import count_list, positive_int

CONFIG = Path(__file__).resolve().parents[2] / "shared" / "golden" / "bench-40layer-tiny" / "config.json"
SEED = 0


def _best(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    return min(seconds(fn, device) for _ in range(repeats))


def _prompt(model: Transformer, n: int, offset: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED + offset)
    return torch.randint(3, model.cfg.vocab_size, (n,), generator=gen)


def prefill_seconds(model: Transformer, tokens: torch.Tensor, decoder_replay: bool, repeats: int) -> float:
    """Best seconds of one whole-prompt prefill into a fresh state."""
    return _best(
        lambda: model.prefill(model.new_state(), tokens, decoder_replay=decoder_replay), model.device, repeats
    )


def decode_step_seconds(model: Transformer, tokens: torch.Tensor, steps: int) -> float:
    """Median seconds of a greedy decode step after prefilling ``tokens``."""
    state = model.new_state()
    token = int(model.prefill(state, tokens).argmax())
    times = []
    out: list[torch.Tensor] = []
    for _ in range(steps + 1):  # the first step is a warm-up
        times.append(seconds(lambda t=token: out.append(model.decode([state], [t])), model.device))
        token = int(out.pop()[0].argmax())
    return statistics.median(times[1:])


def batch_step_seconds(model: Transformer, batches: list[int], context: int, steps: int) -> dict[int, float]:
    """Median seconds of one decode step of each ``batches`` size, each request after its own ``context``-token
    prompt, every batch's caches in one pool as an engine's are (`kvdiet.engine.runner`). The sizes take turns
    step by step (one round: a step of each), so a change in the machine's speed meets them all alike and their
    ratio holds; the first round is a warm-up."""
    runs = []
    for size in batches:
        pool, states, tokens = model.new_pool(4), [], []
        for b in range(size):
            state = model.new_state(pool)
            tokens.append(int(model.prefill(state, _prompt(model, context, offset=1 + b)).argmax()))
            states.append(state)
        runs.append((states, tokens, []))
    out: list[torch.Tensor] = []
    for _ in range(steps + 1):
        for states, tokens, times in runs:
            times.append(seconds(lambda s=states, t=tokens: out.append(model.decode(s, t)), model.device))
            tokens[:] = out.pop().argmax(dim=-1).tolist()
    return {size: statistics.median(times[1:]) for size, (_, _, times) in zip(batches, runs, strict=True)}


def main() -> None:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument(
        "--config", default=str(CONFIG), help="model config (default: the 40-layer tiny plan)"
    )
    parser.add_argument(
        "--tokens", type=count_list, default="256,1024,2048", help="prompt lengths (default 256,1024,2048)"
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=3, help="prefill runs per figure, best kept (default 3)"
    )
    parser.add_argument(
        "--steps", type=positive_int, default=8, help="decode steps per figure, median kept (default 8)"
    )
    parser.add_argument(
        "--batches", type=count_list, default="1,4,16", help="requests per decode step (default 1,4,16)"
    )
    parser.add_argument(
        "--batch-context", type=positive_int, default=256, help="prompt tokens per batched request"
    )
    parser.add_argument(
        "--threads", type=positive_int, help="torch CPU threads (default: the cores this process may use)"
    )
    add_device_arg(parser)
    args = parser.parse_args()
    try:
        check_device(args.device)
        check_threads(args.threads)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        cfg = load_config(args.config)
    except (ConfigError, OSError) as exc:
        parser.error(f"--config: {exc}")
    if max(args.tokens) > cfg.max_position_embeddings or args.batch_context > cfg.max_position_embeddings:
        parser.error(
            f"--tokens and --batch-context must be at most the model's {cfg.max_position_embeddings:,} positions"
        )
    threads = set_threads(args.threads)
    torch.manual_seed(SEED)
    # the golden files' stub Engram map (token i → i // 2): tiny vocabularies have no tokenizer to derive one
    stub = torch.arange(cfg.vocab_size) * cfg.engram_compressed_vocab_size // cfg.vocab_size
    model = Transformer.from_config(cfg, seed=SEED, token_map=stub if cfg.engram_layer_ids else None)
    model = place(model.eval(), args.device)
    err = Console(stderr=True)

    rows = []
    with torch.inference_mode():
        for n in args.tokens:
            err.print(f"bench_prefill: {n} tokens", highlight=False)
            tokens = _prompt(model, n)
            full = prefill_seconds(model, tokens, False, args.repeats)
            replay = prefill_seconds(model, tokens, True, args.repeats)
            step = decode_step_seconds(model, tokens, args.steps)
            rows.append(
                {
                    "tokens": n,
                    "full_prefill_s": round(full, 4),
                    "full_prefill_tok_s": round(n / full, 1),
                    "replay_prefill_s": round(replay, 4),
                    "replay_speedup": round(full / replay, 3),
                    "decode_step_ms": round(step * 1e3, 2),
                }
            )
        err.print(f"bench_prefill: decode batches {args.batches}, taking turns", highlight=False)
        steps = batch_step_seconds(model, args.batches, args.batch_context, args.steps)
        scaling = [
            {"batch": b, "step_ms": round(t * 1e3, 2), "tok_s": round(b / t, 1)} for b, t in steps.items()
        ]
    one = scaling[0]["tok_s"] if scaling and scaling[0]["batch"] == 1 else None
    for s in scaling:
        s["x_single"] = round(s["tok_s"] / one, 2) if one else None

    name, machine = Path(args.config).parent.name, machine_name(args.device)
    t1 = Table(title=f"prefill and decode, {name} (fp32, {threads} threads) on {machine}")
    for col in (
        "tokens",
        "full prefill s",
        "tok/s",
        "bounded-replay prefill s",
        "speed-up",
        "decode step ms",
    ):
        t1.add_column(col, justify="right")
    for r in rows:
        t1.add_row(
            f"{r['tokens']:,}",
            f"{r['full_prefill_s']:.3f}",
            f"{r['full_prefill_tok_s']:,.0f}",
            f"{r['replay_prefill_s']:.3f}",
            f"{r['replay_speedup']:.2f}×",
            f"{r['decode_step_ms']:.1f}",
        )
    t2 = Table(title=f"decode batch scaling ({args.batch_context}-token contexts)")
    for col in ("requests per step", "step ms", "tokens/s", "× one request"):
        t2.add_column(col, justify="right")
    for s in scaling:
        x = f"{s['x_single']:.2f}×" if s["x_single"] is not None else ""
        t2.add_row(str(s["batch"]), f"{s['step_ms']:.1f}", f"{s['tok_s']:,.1f}", x)
    out = Console()
    out.print(t1)
    out.print(t2)
    print(
        json.dumps(
            {
                "bench": "prefill",
                "seed": SEED,
                "config": name,
                "threads": threads,
                "device": args.device,
                "machine": machine,
                "rows": rows,
                "batch_scaling": scaling,
            }
        )
    )


if __name__ == "__main__":
    main()
