"""``kvdiet fidelity``: flags, prompts, the three experiments, the table, ``--json`` and ``--report``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvdiet.engine.progress import StepProgress
from kvdiet.engine.weights_args import add_numerics_arg, resolve_model
from kvdiet.text_files import read_text
from kvdiet.units import comma_items, parse_count, parse_flag

__all__ = ["add_fidelity_parser", "run_fidelity"]

_TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h", ".json")
RANDOM_CAVEAT = (
    "These weights are seeded random: the figures describe the mechanism (how much each approximation moves "
    "a model's next-token distribution), not the released model. Run with --weights on the released "
    "checkpoint for the numbers the tech report did not give."
)
DEFAULT_ROWS = 16
"""``--rows``' default: positions measured before each context (the model's sliding window when shorter)."""
CHECKPOINT_CAVEAT = (
    "Measured on the checkpoint named above, each figure against its exact counterpart in this run."
)


def add_fidelity_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``kvdiet fidelity``."""
    p = sub.add_parser(
        "fidelity",
        help="measure FP4/MXFP4/FP8 caches, CSA2 selection sharing and bounded replay against exact runs",
        description="Run real text prompts through the model and measure, each against its exact counterpart in "
        "the same run: (1) cache precision — FP4 main KV, MXFP4 index keys, FP8 window, alone and together, vs "
        "fp32 caches (KL, top-1, max |Δlogit|, top-k overlap); (2) CSA2 selection — Reuse layers' borrowed "
        "top-k vs their own attention's, Reindex vs their source, the candidate pool's recall of the dense "
        "top-k; (3) bounded replay — encoder-side after a prefix hit vs a cold prefill, decoder-side vs the full "
        "decoder (KL, top-1, greedy continuation agreement), per context length and hit length.",
        epilog="examples:\n"
        "  kvdiet fidelity --model v4.1-mini --prompts /usr/lib/python3.11/json --report out/\n"
        "  kvdiet fidelity --weights /path/to/DeepSeek-V4.1-Flash --prompts docs/ --contexts 4K,16K,64K --json\n"
        "  kvdiet fidelity --model v4.1-micro --prompt-ids $(seq -s, 3 60) --contexts 48\n"
        "      # token ids, for models without a tokenizer (v4.1-micro: a vocabulary of 64, 256 positions)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument(
        "--model",
        help="a V4.1 preset or config path (default: --weights' config.json, else v4.1-mini); the experiments "
        "measure V4.1's caches, CSA2 sharing and bounded replay, so V4-Flash configs are refused",
    )
    p.add_argument("--weights", help="a checkpoint folder (the released layout) instead of random weights")
    add_numerics_arg(p)
    p.add_argument("--seed", type=int, default=0, help="seed of random weights (default 0)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--prompts", help="a text file, or a folder of text files (.py .txt .md .rst …), one prompt each"
    )
    src.add_argument("--prompt-ids", help="one prompt as comma-separated token ids")
    p.add_argument(
        "--max-prompts", type=int, default=2, help="prompts taken from a folder, in name order (default 2)"
    )
    p.add_argument(
        "--contexts", default="256,512,1K", help="context lengths, K = 1,000 tokens (default 256,512,1K)"
    )
    p.add_argument(
        "--rows",
        type=int,
        help=f"positions measured before each context, at most the model's sliding window (default {DEFAULT_ROWS}, "
        "or the window when it is shorter)",
    )
    p.add_argument("--chunk", default="512", help="prefill chunk in tokens (default 512)")
    p.add_argument(
        "--hits",
        default="auto",
        help="prefix-hit lengths for encoder-side replay, comma-separated (default: 2 block-aligned lengths "
        "between the window and the longest context: just above the window and one block short of it)",
    )
    p.add_argument("--continuation", type=int, default=8, help="greedy tokens compared after each replay (8)")
    p.add_argument(
        "--report",
        metavar="DIR",
        help="write report.md and PNG plots into DIR (made if missing; its parent must exist)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run_fidelity(args: argparse.Namespace, console: Console) -> None:
    """Run ``kvdiet fidelity``. Raises ValueError/ConfigError on bad input (before the model loads)."""
    import torch

    from kvdiet.config import ModelConfig, load_config
    from kvdiet.engine.command import parse_prompt_ids
    from kvdiet.fidelity.experiments import as_dicts, cache_precision, csa2_selection, reached, replay
    from kvdiet.model.build import load_model

    contexts = sorted(
        {parse_flag("--contexts", parse_count, c) for c in comma_items("--contexts", args.contexts, "counts")}
    )
    chunk = parse_flag("--chunk", parse_count, args.chunk)
    if not contexts or contexts[0] < 1:
        raise ValueError(f"--contexts needs positive token counts, got {args.contexts!r}")
    for flag, value, least in (
        ("--rows", args.rows, 1),
        ("--chunk", chunk, 1),
        ("--max-prompts", args.max_prompts, 1),
        ("--continuation", args.continuation, 0),
    ):
        if value is not None and value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    hit_counts = _hit_counts(args.hits)  # the syntax before the model loads; the range needs its window
    files = _prompt_files(args.prompts) if args.prompts else []
    if args.report:  # fail on a bad path before the model loads; the folder is made, not its parents
        try:
            Path(args.report).mkdir(exist_ok=True)
        except FileNotFoundError:
            parent = Path(args.report).absolute().parent
            raise ValueError(
                f"--report {args.report}: {parent} does not exist (the report's folder is made, not its parents)"
            ) from None
        except (FileExistsError, NotADirectoryError):
            raise ValueError(f"--report {args.report}: a file is in the way (a folder is needed)") from None
        except OSError as exc:
            raise ValueError(f"--report {args.report}: {(exc.strerror or str(exc)).lower()}") from None
    prompt_ids = None if args.prompt_ids is None else parse_prompt_ids(args.prompt_ids)
    resolve_model(args)
    cfg = load_config(args.model)
    if isinstance(cfg, ModelConfig) and not cfg.is_v41:
        raise ValueError(
            f"--model {args.model}: kvdiet fidelity measures DeepSeek-V4.1's caches, CSA2 sharing and bounded replay;"
            " this is a V4-Flash config (give a V4.1 one, e.g. v4.1-mini)"
        )
    model, tokenizer = load_model(args.model, seed=args.seed, weights=args.weights, numerics=args.numerics)
    window = model.cfg.sliding_window
    if args.rows is None:  # the default fits every model (v4.1-micro's window is 8)
        args.rows = min(DEFAULT_ROWS, window)
    if args.rows > window:
        raise ValueError(
            f"--rows {args.rows} exceeds the sliding window {window} (bounded replay keeps that many)"
        )
    prompts, names = _prompts(args, prompt_ids, files, tokenizer, limit=args.max_prompts)
    longest = max(p.numel() for p in prompts)
    if longest < contexts[0]:
        raise ValueError(
            f"no prompt reaches the shortest context {contexts[0]:,} (the longest has {longest:,} tokens): "
            "lower --contexts or give longer prompts"
        )
    if skipped := [f"{c:,}" for c in contexts if c > longest]:  # the lengths no prompt reaches: not measured
        note = f"--contexts {', '.join(skipped)} skipped: the longest prompt has {longest:,} tokens"
        print(f"kvdiet fidelity: {note}", file=sys.stderr)
    contexts = [c for c in contexts if c <= longest]
    limit = model.cfg.max_position_embeddings
    if limit is not None and contexts[-1] + args.continuation > limit:
        raise ValueError(
            f"--contexts {contexts[-1]:,} + --continuation {args.continuation} = "
            f"{contexts[-1] + args.continuation:,} tokens > max_position_embeddings {limit:,}: lower either"
        )
    top = contexts[-1]
    hits = _hits(hit_counts, window=window, top=top)
    label = (
        f"{args.weights} ({model.load_report.numerics} numerics)"
        if args.weights
        else f"{args.model}, random weights (seed {args.seed})"
    )
    started = time.perf_counter()
    measured = sum(bool(reached(p, contexts)) for p in prompts)  # the prompts each experiment measures
    bar = StepProgress(  # minutes of work: a bar on a terminal, a line every 10 s in a log
        3 * measured, stream=sys.stderr, label="fidelity", unit="prompt runs (3 experiments)",
        rate_unit="prompt runs/s",
    )  # fmt: skip
    with torch.inference_mode(), bar:
        step = lambda: bar.advance(1)  # noqa: E731
        points = {
            "cache_precision": cache_precision(
                model, prompts, contexts, rows=args.rows, chunk=chunk, done=step
            ),
            "csa2_selection": csa2_selection(
                model, prompts, contexts, rows=args.rows, chunk=chunk, done=step
            ),
            "replay": replay(
                model,
                prompts,
                contexts,
                rows=args.rows,
                chunk=chunk,
                hits=hits,
                continuation=args.continuation,
                done=step,
            ),
        }
    result = {
        "weights_label": label,
        "random_weights": args.weights is None,
        "caveat": RANDOM_CAVEAT if args.weights is None else CHECKPOINT_CAVEAT,
        "model": args.model,
        "prompts": len(prompts),
        "prompt_names": names,
        "prompt_tokens": [int(p.numel()) for p in prompts],
        "contexts": contexts,
        "decoder_start": model.plan.decoder_start,
        "rows": args.rows,
        "chunk": chunk,
        "hits": hits,
        "continuation": args.continuation,
        "seconds": round(time.perf_counter() - started, 1),
        **{name: as_dicts(pts) for name, pts in points.items()},
    }
    if args.report:
        from kvdiet.fidelity.report import write_report

        result["report_files"] = [str(p) for p in write_report(args.report, result, points)]
    if args.json:
        print(json.dumps(result))
        return
    console.print(f"[bold]weights:[/bold] {label}")
    console.print(result["caveat"], style="yellow" if args.weights is None else None)
    for name, pts in points.items():
        table = Table(title=name.replace("_", " "))
        for col in ("variant", "measure", "context", "hit", "value", "n"):
            table.add_column(col, justify="right" if col in ("context", "hit", "value", "n") else "left")
        for p in pts:
            hit = "" if p.hit is None else f"{p.hit:,}"
            table.add_row(p.variant, p.measure, f"{p.context:,}", hit, f"{p.value:.4g}", f"{p.n:,}")
        console.print(table)
    if args.report:
        console.print(f"report: {Path(args.report) / 'report.md'}")


def _prompt_files(spec: str) -> list[Path]:
    path = Path(spec)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(f for f in path.iterdir() if f.is_file() and f.suffix in _TEXT_SUFFIXES)
        if files:
            return files
        raise ValueError(f"--prompts {spec}: no text files ({' '.join(_TEXT_SUFFIXES)}) in the folder")
    if path.exists():  # a device, a pipe or a socket (/dev/zero read without end)
        raise ValueError(f"--prompts {spec}: not a regular file or a folder")
    raise ValueError(f"--prompts {spec}: no such file or folder")


def _prompts(
    args: argparse.Namespace, ids: list[int] | None, files: list[Path], tokenizer, *, limit: int
) -> tuple[list, list[str]]:
    import torch

    if ids is not None:  # --prompt-ids, parsed before the model loaded
        return [torch.tensor(ids, dtype=torch.int64)], ["--prompt-ids"]
    if tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer; give --prompt-ids")
    prompts, names = [], []
    for f in files[:limit]:
        try:
            text = read_text(f)
        except ValueError as exc:  # a binary file (refused, not run as a prompt of U+FFFD), one past the cap
            raise ValueError(f"--prompts {exc}") from None
        if text.strip():
            prompts.append(torch.tensor([tokenizer.bos_token_id, *tokenizer.encode(text)], dtype=torch.int64))
            names.append(f.name)
    if not prompts:
        raise ValueError("--prompts: every file is empty")
    return prompts, names


def _hit_counts(spec: str) -> list[int] | None:
    """``--hits``' token counts, increasing (None for ``auto``).

    Raises:
        ValueError: a count that does not parse, named with the flag.
    """
    if spec == "auto":
        return None
    return sorted({parse_flag("--hits", parse_count, h) for h in spec.split(",") if h.strip()})


def _hits(counts: list[int] | None, *, window: int, top: int) -> list[int]:
    """Prefix-hit lengths: ``counts`` (`_hit_counts`) where each is even and between the window and the longest
    context, else (None) block-aligned ones (multiples of 64) there."""
    if counts is not None:
        hits = counts
        bad = [h for h in hits if h % 2 or not window < h < top]
        if bad:
            raise ValueError(f"--hits {bad}: each must be even and between the window {window} and {top}")
        return hits
    align = 64 if top - window >= 256 else 2  # blocks of 64 tokens; any even hit on a short context
    lo, hi = (window // align + 1) * align, (top - align) // align * align  # just above the window; one short
    return sorted({lo, hi}) if window < lo <= hi < top else []
