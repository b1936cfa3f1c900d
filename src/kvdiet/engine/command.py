"""``kvdiet generate``: flags, one prompt through the model and its cache system (`generate_prepared`), and
the summary: speed, measured cache bytes, where the prompt's tokens came from, weights and peak memory.

Building the parser imports no torch; the model and the cache are imported when the command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

from rich.console import Console

from kvdiet.cache.plan import WindowSource
from kvdiet.engine.args import KV_CACHE_DTYPES, EngineArgs
from kvdiet.engine.prepared import ContextLengthError
from kvdiet.text_files import read_text
from kvdiet.units import comma_items

__all__ = ["add_generate_parser", "run_generate"]


def add_generate_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``generate`` sub-command to ``sub``."""
    gen = sub.add_parser(
        "generate",
        help="run the V4.1 model on a prompt with real packed caches and report speed and cache bytes",
        description="Tokenize a prompt with the real DeepSeek tokenizer, prefill it in chunks (decoder "
        "layers on the last window rows only, unless --no-decoder-replay), decode, and print the text "
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
        help="preset or V4.1 / V4-Flash config path (default: the config.json beside --weights, else v4.1-mini)",
    )
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-file", help="file whose text is the prompt")
    source.add_argument("--prompt-ids", help="comma-separated token ids (for models without a tokenizer)")
    gen.add_argument("--max-tokens", type=int, default=None, help="tokens to generate (default 16)")
    gen.add_argument("--chunk-size", type=int, default=512, help="prefill chunk in tokens (default 512)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1.0)")
    gen.add_argument(
        "--top-k",
        type=int,
        default=0,
        help="sample from the k most likely tokens (default 0; 0 or -1 = all, as vLLM's)",
    )
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
    return gen


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
    if p["global_pool_tokens"]:
        parts.append(f"{p['global_pool_tokens']:,} from the global pool,")
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


def run_generate(args: argparse.Namespace, console: Console) -> None:
    """Run ``kvdiet generate``: every flag and the request are checked before any pool or tier is opened.

    Raises:
        ValueError, ConfigError, OSError: bad flags, model or prompt. NoFreeBlocksError: the pool is too small.
    """
    from kvdiet.engine.generate import check_request, generate_prepared
    from kvdiet.engine.runner import ModelRunner
    from kvdiet.engine.sampling import SamplingParams
    from kvdiet.model.build import load_model

    if not args.progress_interval >= 0:
        raise ValueError(f"--progress-interval must be >= 0 seconds, got {args.progress_interval}")
    if args.chunk_size < 1:
        raise ValueError(f"--chunk-size must be >= 1, got {args.chunk_size}")
    try:
        params = SamplingParams(
            max_tokens=16 if args.max_tokens is None else args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
        )
    except ValueError as exc:  # name the flag, not the field: "max_tokens must be …" → "--max-tokens: …"
        field = str(exc).split(" ", 1)[0]
        raise ValueError(f"--{field.replace('_', '-')}: {exc}") from None
    try:
        text = read_text(args.prompt_file) if args.prompt_file is not None else args.prompt
    except ValueError as exc:  # "x: no such file or directory", "x: not UTF-8 text ...", "x: more than ..."
        raise ValueError(f"--prompt-file {exc}") from None
    # before the model loads
    prompt_ids = None if args.prompt_ids is None else parse_prompt_ids(args.prompt_ids)
    engine_args = EngineArgs.from_cli_args(args)  # every cache flag checked before the model loads
    if engine_args.max_model_len is not None:
        engine_args.validate()  # in [1, max_position_embeddings] and one request of it fits the pool
    else:
        engine_args.check_kv_memory()  # the pool fits in memory (no request length to hold it against)
    model, tokenizer = load_model(
        engine_args.model,
        seed=engine_args.seed,
        weights=engine_args.weights,
        exact=KV_CACHE_DTYPES[engine_args.kv_cache_dtype],
        numerics=engine_args.numerics,
        expert_cache_bytes=engine_args.expert_cache_bytes,
        device=engine_args.device,
    )
    if args.prompt_ids is not None:
        ids = prompt_ids
    elif tokenizer is None:
        raise ValueError(
            f"model {args.model!r} has no tokenizer (vocab {model.cfg.vocab_size}); use --prompt-ids"
        )
    else:
        if not text:
            raise ValueError("empty prompt: the prompt text has no characters")
        ids = [tokenizer.bos_token_id, *tokenizer.encode(text)]
        params = dataclasses.replace(params, stop_token_ids=(tokenizer.eos_token_id,))
    try:
        # once, before any pool is allocated
        request = check_request(model, ids, params, max_model_len=engine_args.max_model_len)
    except ValueError as exc:
        if isinstance(exc, ContextLengthError):  # it names the prompt and max_tokens already, and whence
            raise exc.with_origin(
                "--max-tokens" if args.max_tokens is not None else "--max-tokens' default"
            ) from None
        flag = (
            "--prompt-ids"
            if args.prompt_ids is not None
            else "--prompt-file"
            if args.prompt_file is not None
            else "--prompt"
        )
        raise ValueError(f"{flag}: {exc}") from None
    identity = tokenizer.identity if tokenizer else "none"
    runner = ModelRunner(model, engine_args.cache, tokenizer_id=identity, threads=args.thread_pool)
    with runner:
        result = generate_prepared(
            model,
            request,
            cache=runner,
            chunk_size=args.chunk_size,
            progress=True,
            progress_interval_s=args.progress_interval,
        )
        stats = runner.stats.as_dict()
    cache, decode_rate = result.cache, result.decode_tokens_per_second  # None: no decode step ran
    summary = {
        "model": args.model,
        "prompt_tokens": result.prompt_tokens,
        "output_tokens": len(result.output_ids),
        "finish_reason": result.finish_reason,
        "prefill_seconds": round(result.prefill_seconds, 3),
        "prefill_computed_tokens": result.provenance.computed_tokens + result.provenance.replayed_tokens,
        "prefill_computed_tokens_per_second": round(result.prefill_computed_tokens_per_second, 1),
        "decode_tokens_per_second": None if decode_rate is None else round(decode_rate, 2),
        "global_kv_bytes_per_token": round(cache.global_bytes_per_token, 3),
        "global_kv_bytes_per_covered_token": cache.global_bytes_per_covered_token,
        "open_pair_tokens": max(cache.num_tokens - c for c in cache.covered_tokens.values()),
        "global_kv_bytes": cache.global_bytes,
        "window_bytes": cache.window_bytes,
        "compressor_tail_bytes": cache.tail_bytes,
        "total_cache_bytes": cache.total_bytes,
        "decoder_replay": runner.decoder_replay,
        "swa_policy": str(engine_args.cache.policy),
        "kv_cache_dtype": engine_args.kv_cache_dtype,
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


def parse_prompt_ids(text: str) -> list[int]:
    """``--prompt-ids``' comma-separated token ids (``generate``, ``fidelity``): plain decimal integers (ASCII
    digits, an optional minus; the range is the model's check), named by their item number when one is not.

    Raises:
        ValueError: an empty item or one that is not such an integer.
    """
    if not text.strip():
        return []
    items = comma_items("--prompt-ids", text, "ids")
    for i, t in enumerate(items, 1):
        if not re.fullmatch(r"-?[0-9]+", t):
            raise ValueError(f"--prompt-ids: item {i} ({t!r}) is not an integer")
        if len(t) > 20:  # past any vocabulary (and Python's 4,300-digit int() limit), named here
            raise ValueError(f"--prompt-ids: item {i} ({t[:12]}…, {len(t)} digits) is outside any vocabulary")
    return [int(t) for t in items]
