"""The ``kvdiet`` command line: ``plan`` (bytes and capacity of a config), ``generate`` (run the model on one
prompt), ``serve`` (the OpenAI-compatible server), ``replay`` (the trace study: `kvdiet.sim`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from rich.console import Console

from kvdiet import __version__
from kvdiet.cache.block_pool import NoFreeBlocksError
from kvdiet.cache.plan import WindowSource
from kvdiet.config import PRESETS, ConfigError, load_config
from kvdiet.engine.args import EngineArgs, add_numerics_arg
from kvdiet.planner.report import GPUS, PlanOptions, compare_reports, plan_report
from kvdiet.units import parse_count

__all__ = ["main"]

_T = TypeVar("_T")

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


class _ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with two changes that every ``kvdiet`` parser gets, sub-commands included (they are
    made with the parent's class):

    - no abbreviated flags: ``--max-num-seq`` is an error, never ``--max-num-seqs`` (``allow_abbrev``);
    - an argument that starts with a dash and a digit is a value, not a flag (argparse only takes
      ``-5`` or ``-0.5`` so), so ``--swa-pool-ttl -5m`` gets the flag's own error ("must be > 0") instead of
      "expected one argument". No ``kvdiet`` flag looks like a negative number.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d")


def _build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(
        prog="kvdiet",
        description="DeepSeek-V4.1-Flash KV-cache system: plan, run and measure it.",
        epilog="Arguments can come from a file, one per line: kvdiet generate @args.txt (e.g. a long "
        "--prompt-ids list).",
        fromfile_prefix_chars="@",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
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
        "--gpu",
        choices=sorted(GPUS),
        default="h200",
        help="named device: "
        + ", ".join(f"{name} {gb:g} GB" for name, gb in GPUS.items())
        + " (default h200)",
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
    gen.add_argument(
        "--model",
        help="preset or V4.1 config path (default: the config.json beside --weights, else v4.1-mini)",
    )
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-file", help="file whose text is the prompt")
    source.add_argument("--prompt-ids", help="comma-separated token ids (for models without a tokenizer)")
    gen.add_argument("--max-tokens", type=int, default=16, help="tokens to generate (default 16)")
    gen.add_argument("--chunk-size", type=int, default=512, help="prefill chunk in tokens (default 512)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1.0)")
    gen.add_argument("--seed", type=int, default=0, help="weights and sampling seed (default 0)")
    EngineArgs.add_cli_args(gen)
    gen.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    gen.add_argument(
        "--progress-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="prefill progress goes to stderr: a bar on a terminal, else a line every SECONDS (default 10; "
        "0 = after every chunk)",
    )
    from kvdiet.server.serve import add_serve_parser

    add_serve_parser(sub)
    from kvdiet.sim.command import add_replay_parser

    add_replay_parser(sub)
    _add_golden_parser(sub)
    from kvdiet.fidelity.command import add_fidelity_parser

    add_fidelity_parser(sub)
    return parser


def _add_golden_parser(sub: argparse._SubParsersAction) -> None:
    gold = sub.add_parser(
        "golden",
        help="hold a reference dump (checkpoint + reference outputs) against kvdiet",
        description="Load a directory in the shared/golden layout (config.json, safetensors weights in the "
        "released format, reference_outputs.safetensors), run its prompt through kvdiet, feed its decode "
        "tokens, and print how many prompt rows, argmaxes, greedy decode tokens, per-layer top-k sets and "
        "caches agree, and where they first diverge.",
        epilog="examples:\n  kvdiet golden ../shared/golden/tiny-fp8\n"
        "  kvdiet golden ../shared/golden/tiny-fp8 --json\n"
        "  kvdiet golden DIR --numerics bf16 --check     # exit 1 unless the acceptance holds",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    gold.add_argument("directory", help="folder with config.json, weights and reference_outputs.safetensors")
    add_numerics_arg(gold)
    gold.add_argument(
        "--tol",
        type=float,
        default=1e-3,
        help="a row agrees when max|Δlogit| ≤ tol·max|logit| (default 1e-3)",
    )
    gold.add_argument("--json", action="store_true", help="print the report as one JSON object")
    gold.add_argument(
        "--check", action="store_true", help="exit 1 unless the golden README's acceptance holds"
    )


def _weights_summary(model: object, args: argparse.Namespace) -> dict:
    """Weights, numerics, routed-expert reads and the process's peak resident memory (``generate``)."""
    report = getattr(model, "load_report", None)
    out: dict = {
        "weights": args.weights or f"random (seed {args.seed})",
        "numerics": "bf16" if report is None else report.numerics,
    }
    if report is not None and report.expert_cache is not None:
        st = report.expert_cache.stats()
        out["expert_cache"] = {
            "budget_bytes": st.budget_bytes,
            "loads": st.loads,
            "hits": st.hits,
            "evictions": st.evictions,
            "bytes_read": st.bytes_read,
            "peak_bytes": st.peak_bytes,
        }
    out["checkpoint_bytes"] = None if report is None else report.checkpoint_bytes
    out["peak_rss_bytes"] = _peak_rss_bytes()
    return out


def _peak_rss_bytes() -> int:
    """This process's peak resident memory: ``VmHWM`` (per address space, so a parent's peak before ``exec``
    does not count, unlike ``ru_maxrss``), else ``ru_maxrss``."""
    import resource

    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _provenance_line(p: dict) -> str:
    """One line saying where the prompt's tokens came from."""
    parts = [f"{p['prompt_tokens']:,} prompt tokens:"]
    if p["device_tokens"]:
        parts.append(f"{p['device_tokens']:,} from the device pool,")
    if p["persistent_tokens"]:
        parts.append(f"{p['persistent_tokens']:,} from the persistent tier,")
    if p["hit_tokens"]:
        where = WindowSource(p["window_source"])
        if where is WindowSource.REPLAY:
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

    if not args.progress_interval >= 0:
        raise ValueError(f"--progress-interval must be >= 0 seconds, got {args.progress_interval}")
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    text = Path(args.prompt_file).read_text(errors="replace") if args.prompt_file else args.prompt
    engine_args = EngineArgs.from_cli_args(args)  # every cache flag checked before the model loads
    model, tokenizer = load_model(
        engine_args.model,
        seed=engine_args.seed,
        weights=engine_args.weights,
        numerics=engine_args.numerics,
        expert_cache_bytes=engine_args.expert_cache_bytes,
    )
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
    cache = KVCache(model, engine_args.cache, tokenizer_id=tokenizer.identity if tokenizer else "none")
    with cache:
        result = generate(
            model,
            ids,
            params,
            cache=cache,
            chunk_size=args.chunk_size,
            progress=True,
            progress_interval_s=args.progress_interval,
        )
        stats = cache.stats.as_dict()
    cache = result.cache
    summary = {
        "model": args.model,
        "prompt_tokens": result.prompt_tokens,
        "output_tokens": len(result.output_ids),
        "finish_reason": result.finish_reason,
        "prefill_seconds": round(result.prefill_seconds, 3),
        "prefill_computed_tokens": result.provenance.computed_tokens + result.provenance.replayed_tokens,
        "prefill_computed_tokens_per_second": round(result.prefill_computed_tokens_per_second, 1),
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
        **_weights_summary(model, args),
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
        reports = [plan_report(load_config(name), options) for name in args.compare]
        result = compare_reports(*reports)
        if args.json:
            print(json.dumps(result))
        else:
            render_compare(result, console)
    else:
        reports = [plan_report(load_config(args.config), options)]
        if args.json:
            print(json.dumps(reports[0]))
        else:
            render_report(reports[0], console)
    if args.json or args.compare:  # the text report prints its own warning under the capacity line
        for report in reports:
            if warning := report["capacity"]["warning"]:
                print(f"kvdiet plan: warning: {report['config']}: {warning}", file=sys.stderr)
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
        elif args.command == "fidelity":
            from kvdiet.fidelity.command import run_fidelity

            run_fidelity(args, console)
        elif args.command == "golden":
            from kvdiet.model.golden import run_golden_command

            return run_golden_command(args, console)
    except (ConfigError, ValueError, OSError, NoFreeBlocksError) as exc:
        print(f"kvdiet {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl+C: one line and the shell's status for SIGINT, no traceback
        print(f"kvdiet {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
