"""The ``kvdiet`` command line: ``plan`` (bytes and capacity of a config), ``generate`` (run the model on one
prompt), ``serve`` (the OpenAI-compatible server), ``replay`` (the trace study: `kvdiet.sim`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.console import Console

from kvdiet.cache.block_pool import NoFreeBlocksError
from kvdiet.config import PRESETS, ConfigError, load_config
from kvdiet.planner.report import GPUS, PlanOptions, compare_reports, plan_report
from kvdiet.units import parse_bytes, parse_count, parse_duration

if TYPE_CHECKING:
    from kvdiet.engine.kv_cache import CacheOptions

__all__ = ["main"]

PLAN_EPILOG = """\
examples:
  kvdiet plan configs/deepseek-v4.1-flash.json            # the real V4.1-Flash config
  kvdiet plan deepseek-v4.1-flash --json                  # the same as JSON, for scripts
  kvdiet plan v4.1-mini --contexts 4K,32K,1Mi             # totals at chosen context lengths
  kvdiet plan deepseek-v4.1-flash --gpu b200 --num-gpus 4 --context 1M
  kvdiet plan --compare deepseek-v4.1-flash deepseek-v4-flash
  kvdiet plan --plot kv_vs_context.png

Units: token counts take decimal K/M (128K = 128,000) or binary Ki/Mi (1Mi = 1,048,576); bytes are
printed in decimal units (GB = 1e9 B). Presets: """ + ", ".join(PRESETS)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvdiet",
        description="DeepSeek-V4.1-Flash KV-cache system: plan, run and measure it.",
        epilog="Arguments can come from a file, one per line: kvdiet generate @args.txt (e.g. a long "
        "--prompt-ids list).",
        fromfile_prefix_chars="@",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan = sub.add_parser(
        "plan",
        help="layer plan, KV bytes per token, window state, SWA-policy storage and capacity of a config",
        description="Print the layer plan of a config and what its caches cost: global KV bytes per token "
        "by component and layer, the fixed window state per request, totals at context lengths, persistent "
        "bytes per SWA policy, and how many sessions fit on a set of GPUs after the weights.",
        epilog=PLAN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument(
        "config",
        nargs="?",
        default="deepseek-v4.1-flash",
        help="a preset name or a HF config.json path (default: deepseek-v4.1-flash)",
    )
    plan.add_argument("--json", action="store_true", help="print the report as one JSON object")
    plan.add_argument(
        "--compare", nargs=2, metavar=("A", "B"), help="two configs side by side, with A/B ratios"
    )
    plan.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw global KV vs context (V4.1-Flash, V4-Flash, DeepSeek-LLM-67B)",
    )
    plan.add_argument(
        "--contexts", default="4K,128K,1M", help="comma-separated context lengths (default 4K,128K,1M)"
    )
    plan.add_argument("--context", default="128K", help="context of one session for capacity (default 128K)")
    plan.add_argument(
        "--gpu", choices=sorted(GPUS), default="h200", help="named device (h200 141 GB, b200 192 GB)"
    )
    plan.add_argument("--gpu-mem-gb", type=float, help="memory of one device in GB (overrides --gpu)")
    plan.add_argument("--num-gpus", type=int, default=8, help="devices holding weights and cache (default 8)")
    plan.add_argument(
        "--weights-gb", type=float, help="device weight bytes in GB (default: estimated from the config)"
    )
    plan.add_argument(
        "--tokens-per-boundary",
        default="1024",
        help="tokens between prompt/output ends, to amortise boundary snapshots (default 1024)",
    )
    plan.add_argument(
        "--checkpoint-every", default="4096", help="K of the checkpoint:K policy row (default 4096)"
    )
    gen = sub.add_parser(
        "generate",
        help="run the V4.1 model on a prompt with real packed caches and report speed and cache bytes",
        description="Tokenize a prompt with the real DeepSeek tokenizer, prefill it in chunks (decoder "
        "layers on the last window rows only, unless --no-swa-bounded-replay), decode, and print the text "
        "and a summary: prompt tokens, prefill and decode tok/s, measured global KV bytes per token, window "
        "bytes, total cache bytes. Weights are seeded random unless --weights is given, so the text is "
        "meaningless; the caches, their bytes and the speed are real.",
        epilog="examples:\n  kvdiet generate --model v4.1-mini --prompt 'The KV cache' --max-tokens 8\n"
        "  kvdiet generate --model v4.1-mini --prompt-file /usr/lib/python3.11/typing.py --json\n"
        "  kvdiet generate --model v4.1-micro --prompt-ids 5,6,7 --max-tokens 4",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen.add_argument("--model", default="v4.1-mini", help="preset or V4.1 config path (default v4.1-mini)")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-file", help="file whose text is the prompt")
    source.add_argument("--prompt-ids", help="comma-separated token ids (for models without a tokenizer)")
    gen.add_argument("--max-tokens", type=int, default=16, help="tokens to generate (default 16)")
    gen.add_argument("--chunk-size", type=int, default=512, help="prefill chunk in tokens (default 512)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1.0)")
    gen.add_argument("--seed", type=int, default=0, help="weights and sampling seed (default 0)")
    gen.add_argument("--weights", help="safetensors file or folder (DeepSeek tensor names) instead of random")
    add_cache_args(gen.add_argument_group("cache system"))
    gen.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    from kvdiet.server.serve import add_serve_parser

    add_serve_parser(sub)
    from kvdiet.sim.command import add_replay_parser

    add_replay_parser(sub)
    return parser


def add_cache_args(group: argparse._ArgumentGroup, *, persistent_default: str | None = None) -> None:
    """The cache-system flags of ``generate`` and ``serve`` (read back by `cache_options`)."""
    group.add_argument(
        "--kv-cache-memory", default="1GiB", help="device-pool budget for global KV (default 1GiB)"
    )
    group.add_argument("--block-size", type=int, default=64, help="tokens per block (default 64)")
    group.add_argument(
        "--persistent-dir",
        default=persistent_default,
        help="directory of the persistent global-KV tier, shared by every process that uses it "
        + (
            f"(default {persistent_default}; 'none' turns the tier off)"
            if persistent_default
            else "(default: no persistent tier); a second run with the same directory gets a persistent hit"
        ),
    )
    group.add_argument("--persistent-ttl", default="72h", help="persistent-tier TTL (default 72h)")
    group.add_argument(
        "--persistent-size", help="persistent-tier capacity, LRU beyond it (default unbounded)"
    )
    group.add_argument(
        "--swa-policy",
        default="bounded-replay",
        help="bounded-replay (default), boundary-snapshot, full-store, checkpoint:K, exact-recompute",
    )
    group.add_argument(
        "--swa-pool",
        default="in-process",
        help="where window snapshots live: in-process (default; dies with the process), "
        "redis://HOST:PORT/DB, several such URLs separated by commas (keys sharded over them), or "
        "redis+cluster://HOST:PORT (a Redis Cluster); shared by every process that names it",
    )
    group.add_argument(
        "--swa-pool-size", help="in-process SWA-pool budget (default 10%% of host RAM; Redis: its maxmemory)"
    )
    group.add_argument("--swa-pool-ttl", default="5m", help="SWA-pool TTL, in-process or Redis (default 5m)")
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="look prompts up in the cache tiers (default on; blocks are written either way)",
    )
    group.add_argument(
        "--no-swa-bounded-replay",
        action="store_true",
        help="run the decoder layers on every prompt row instead of the last window (exact, slower)",
    )


def cache_options(args: argparse.Namespace) -> CacheOptions:
    """`CacheOptions` from the flags of `add_cache_args`. Raises ValueError on a bad value (before anything
    is opened or connected)."""
    from kvdiet.cache.policy import SwaPolicy
    from kvdiet.engine.kv_cache import CacheOptions
    from kvdiet.storage.swa_pool import check_swa_pool_spec

    return CacheOptions(
        kv_cache_memory=parse_bytes(args.kv_cache_memory),
        block_size=args.block_size,
        persistent_dir=None if args.persistent_dir in (None, "none") else args.persistent_dir,
        persistent_ttl_s=parse_duration(args.persistent_ttl),
        persistent_size=parse_bytes(args.persistent_size) if args.persistent_size else None,
        swa_pool=check_swa_pool_spec(args.swa_pool),
        swa_pool_size=parse_bytes(args.swa_pool_size) if args.swa_pool_size else None,
        swa_pool_ttl_s=parse_duration(args.swa_pool_ttl),
        policy=SwaPolicy.parse(args.swa_policy),
        decoder_replay=not args.no_swa_bounded_replay,
        prefix_caching=args.enable_prefix_caching,
    )


def _provenance_line(p: dict) -> str:
    """One line saying where the prompt's tokens came from."""
    parts = [f"{p['prompt_tokens']:,} prompt tokens:"]
    if p["device_tokens"]:
        parts.append(f"{p['device_tokens']:,} from the device pool,")
    if p["persistent_tokens"]:
        parts.append(f"{p['persistent_tokens']:,} from the persistent tier,")
    if p["hit_tokens"]:
        where = p["window_source"]
        if where == "replay":
            parts.append(f"window state at {p['hit_tokens']:,} replayed ({p['replayed_tokens']:,} tokens),")
        else:
            parts.append(f"window state at {p['hit_tokens']:,} from {where}")
            parts.append(f"(+{p['replayed_tokens']:,} recomputed)," if p["replayed_tokens"] else ",")
    parts.append(f"{p['computed_tokens']:,} computed")
    return " ".join(parts).replace(" ,", ",")


def _run_generate(args: argparse.Namespace, console: Console) -> None:
    from pathlib import Path

    from kvdiet.engine.generate import check_request, generate, load_model
    from kvdiet.engine.kv_cache import KVCache
    from kvdiet.engine.sampling import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    text = Path(args.prompt_file).read_text(errors="replace") if args.prompt_file else args.prompt
    options = cache_options(args)  # every cache flag checked before the model loads
    model, tokenizer = load_model(args.model, seed=args.seed, weights=args.weights)
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError as exc:
            raise ValueError(f"--prompt-ids must be comma-separated integers: {exc}") from exc
    elif tokenizer is None:
        raise ValueError(
            f"model {args.model!r} has no tokenizer (vocab {model.cfg.vocab_size}); use --prompt-ids"
        )
    else:
        if not text:
            raise ValueError("empty prompt: the prompt text has no characters")
        ids = [tokenizer.bos_token_id, *tokenizer.encode(text)]
        params = dataclasses.replace(params, stop_token_ids=(tokenizer.eos_token_id,))
    check_request(model, ids, params)  # before any pool is allocated
    cache = KVCache(model, options, tokenizer_id=tokenizer.identity if tokenizer else "none")
    with cache:
        result = generate(model, ids, params, cache=cache, chunk_size=args.chunk_size, progress=not args.json)
        stats = cache.stats.as_dict()
    cache = result.cache
    summary = {
        "model": args.model,
        "prompt_tokens": result.prompt_tokens,
        "output_tokens": len(result.output_ids),
        "finish_reason": result.finish_reason,
        "prefill_seconds": round(result.prefill_seconds, 3),
        "prefill_tokens_per_second": round(result.prefill_tokens_per_second, 1),
        "decode_tokens_per_second": round(result.decode_tokens_per_second, 2),
        "global_kv_bytes_per_token": round(cache.global_bytes_per_token, 3),
        "global_kv_bytes_per_covered_token": cache.global_bytes_per_covered_token,
        "open_pair_tokens": max(cache.num_tokens - c for c in cache.covered_tokens.values()),
        "global_kv_bytes": cache.global_bytes,
        "window_bytes": cache.window_bytes,
        "compressor_tail_bytes": cache.tail_bytes,
        "total_cache_bytes": cache.total_bytes,
        "swa_bounded_replay": not args.no_swa_bounded_replay,
        "swa_policy": args.swa_policy,
        "provenance": result.provenance.as_dict(),
        "cache_stats": stats,
        "output_ids": result.output_ids,
    }
    if tokenizer is not None:
        summary["text"] = tokenizer.decode(result.output_ids)
    if args.json:
        print(json.dumps(summary))
        return
    console.print(summary.get("text", f"output ids: {summary['output_ids']}"), markup=False, highlight=False)
    for key, value in summary.items():
        if key == "provenance":
            console.print(
                f"{key:34s} {_provenance_line(value)}", markup=False, highlight=False, soft_wrap=True
            )
        elif key not in ("text", "output_ids", "cache_stats"):
            console.print(
                f"{key:34s} {value:,}"
                if isinstance(value, int | float) and not isinstance(value, bool)
                else f"{key:34s} {value}",
                markup=False,
                highlight=False,
            )


def _plan_options(args: argparse.Namespace) -> PlanOptions:
    return PlanOptions(
        contexts=tuple(parse_count(c) for c in args.contexts.split(",") if c.strip()),
        capacity_context=parse_count(args.context),
        gpu=args.gpu if args.gpu_mem_gb is None else "custom",
        gpu_mem_gb=GPUS[args.gpu] if args.gpu_mem_gb is None else args.gpu_mem_gb,
        num_gpus=args.num_gpus,
        weights_gb=args.weights_gb,
        tokens_per_boundary=parse_count(args.tokens_per_boundary),
        checkpoint_every=parse_count(args.checkpoint_every),
    )


def _run_plan(args: argparse.Namespace, console: Console) -> None:
    from kvdiet.planner.chart import check_plot_path
    from kvdiet.planner.render import render_compare, render_report

    if args.plot:
        check_plot_path(args.plot)  # before any work
    options = _plan_options(args)
    if args.compare:
        a, b = (plan_report(load_config(name), options) for name in args.compare)
        result = compare_reports(a, b)
        if args.json:
            print(json.dumps(result))
        else:
            render_compare(result, console)
    else:
        report = plan_report(load_config(args.config), options)
        if args.json:
            print(json.dumps(report))
        else:
            render_report(report, console)
    if args.plot:
        from kvdiet.planner.chart import plot_global_kv

        out = plot_global_kv(args.plot)
        (Console(stderr=True) if args.json else console).print(f"wrote {out}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvdiet`` script; returns the exit status (2 on bad input)."""
    args = _build_parser().parse_args(argv)
    console = Console()
    try:
        if args.command == "plan":
            _run_plan(args, console)
        elif args.command == "generate":
            _run_generate(args, console)
        elif args.command == "replay":
            from kvdiet.sim.command import run_replay

            run_replay(args, console)
        elif args.command == "serve":
            from kvdiet.server.serve import run_serve

            run_serve(args)
    except (ConfigError, ValueError, OSError, NoFreeBlocksError) as exc:
        print(f"kvdiet {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
