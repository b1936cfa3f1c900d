"""``kvdiet replay``'s flags, checked before any trace is read and turned into what to run.

Every bad value is one `ValueError` that names its flag (the command prints it as one line, exit 2).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path

from kvdiet.units import comma_items, parse_bytes, parse_bytes_or_unbounded, parse_duration, parse_flag

__all__ = ["DEFAULT_ENGINE_REQUESTS", "MODE_FLAGS", "plan_runs"]

DEFAULT_ENGINE_REQUESTS = 8
"""Requests from the trace's start that ``--mode engine`` replays without ``--max-requests``."""
_ENGINE, _MODEL_FREE, _RUNS = ("engine",), ("model-free",), ("model-free", "engine")
MODE_FLAGS: dict[str, tuple[object, tuple[str, ...]]] = {
    # engine mode only
    "--engine-model": ("v4.1-mini", _ENGINE),
    "--max-requests": (DEFAULT_ENGINE_REQUESTS, _ENGINE),
    "--engine-block-size": (None, _ENGINE),  # chosen from the runs' models
    "--time-scale": (0.0, _ENGINE),
    "--kv-cache-memory": ("1GiB", _ENGINE),
    "--max-num-seqs": (4, _ENGINE),
    "--seed": (0, _ENGINE),
    "--threads": (None, _ENGINE),  # kvdiet.threads: the cores this process may use
    # the model-free study only
    "--model": ("deepseek-v4.1-flash", _MODEL_FREE),
    "--device-size": ("32GB", _MODEL_FREE),
    "--persistent-size": (None, _MODEL_FREE),  # unbounded
    "--swa-pool-supersede": (False, _MODEL_FREE),
    "--global-pool-size": ("0", _MODEL_FREE),
    "--global-pool-ttl": ("1h", _MODEL_FREE),
    "--gpu": ("h200", _MODEL_FREE),
    "--mfu": (0.5, _MODEL_FREE),
    "--output-tok-s": (50.0, _MODEL_FREE),
    "--sweep": (None, _MODEL_FREE),  # the study's default sweeps
    "--sweep-run": ("bounded-replay", _MODEL_FREE),
    "--jobs": (None, _MODEL_FREE),  # the CPU count
    "--simcore": ("auto", _MODEL_FREE),
    # every mode that runs something (not stats)
    "--runs": (None, _RUNS),
    "--persistent-ttl": ("72h", _RUNS),
    "--swa-pool-size": ("200GB", _RUNS),
    "--swa-pool-ttl": ("5m", _RUNS),
    "--progress-interval": (10.0, _RUNS),
}
"""Each flag that not every ``--mode`` uses: its default and the modes that use it. Parsed with a default of None,
so one given in a mode that does not use it, even at its default value, is refused by name rather than ignored."""
_MODES_SAID = {
    _ENGINE: "engine mode only (--mode engine)",
    _MODEL_FREE: "model-free mode only (the default --mode)",
    _RUNS: "the model-free and engine modes only",
}


def plan_runs(args: argparse.Namespace):
    """Check every flag of ``kvdiet replay`` (one ValueError naming the flag) and build what to run: the
    model-free runs and sweeps ``(runs, sweeps)``, the engine-mode configs (a list), or None (``--mode
    stats``)."""
    from kvdiet.config import load_config
    from kvdiet.sim.cost import GPU_FP8_FLOPS, check_gpu
    from kvdiet.sim.records import SimConfig
    from kvdiet.sim.study import DEFAULT_SUPERSEDE_SWEEP, DEFAULT_TTL_SWEEP, parse_run, parse_sweep

    for flag, (default, modes) in MODE_FLAGS.items():
        dest = flag[2:].replace("-", "_")
        if getattr(args, dest, None) is None:
            setattr(args, dest, default)
        elif args.mode not in modes:
            raise ValueError(f"{flag}: {_MODES_SAID[modes]}; --mode {args.mode} does not use it")
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    if not args.progress_interval >= 0:
        raise ValueError(f"--progress-interval must be >= 0 seconds, got {args.progress_interval}")
    if getattr(args, "device", None) not in (None, "cpu") and args.mode != "engine":  # its default: cpu
        raise ValueError(f"--device: engine mode only (--mode engine); --mode {args.mode} runs no model")
    for flag, value, least in (
        ("--max-requests", args.max_requests, 1),
        ("--max-num-seqs", args.max_num_seqs, 1),
        ("--time-scale", args.time_scale, 0),
        ("--output-tok-s", args.output_tok_s, 1e-9),
    ):
        if not (math.isfinite(value) and value >= least):
            bound = "> 0" if least == 1e-9 else f">= {least}"
            kind = "an integer" if isinstance(value, int) else "a finite number"
            raise ValueError(f"{flag} must be {kind} {bound}, got {value}")
    for flag in ("--device-size", "--swa-pool-size", "--persistent-size", "--kv-cache-memory"):
        text = getattr(args, flag[2:].replace("-", "_"))
        if text is None:
            continue
        size = parse_flag(
            flag, parse_bytes_or_unbounded if flag == "--persistent-size" else parse_bytes, text
        )
        if size is not None and size <= 0:
            raise ValueError(f"{flag} must be > 0 bytes, got {text!r}")
    if parse_flag("--global-pool-size", parse_bytes, args.global_pool_size) < 0:
        raise ValueError(f"--global-pool-size must be >= 0 bytes (0: none), got {args.global_pool_size!r}")
    for flag in ("--swa-pool-ttl", "--persistent-ttl", "--global-pool-ttl"):
        parse_flag(flag, parse_duration, getattr(args, flag[2:].replace("-", "_")))
    if args.report:
        _check_report_dir(Path(args.report))
    from kvdiet.sim.study import DEFAULT_RUNS

    if args.runs is None:
        names = list(DEFAULT_RUNS) if args.mode != "engine" else ["bounded-replay"]
    else:
        names = comma_items("--runs", args.runs, "runs")
    if not names:
        raise ValueError("--runs: no runs")
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"--runs: {', '.join(twice)} given twice")
    if args.mode == "engine":
        from kvdiet.cache.policies import parse_policy
        from kvdiet.engine.runner import CacheOptions
        from kvdiet.layer_plan import DEFAULT_BLOCK_SIZE, V4_BLOCK_SIZE, LayerPlan
        from kvdiet.model.memory import check_fits
        from kvdiet.sim.engine_mode import EngineModeConfig

        # each run's engine holds a pool of this size (one at a time): past the memory, refused before any loads
        parse_flag(
            "--kv-cache-memory",
            lambda text: check_fits("the KV cache", parse_bytes(text)),
            args.kv_cache_memory,
        )
        runs = list(
            dict.fromkeys(
                (n.partition("@")[0].strip(), n.partition("@")[2].strip() or args.engine_model) for n in names
            )
        )
        models = {
            m: parse_flag("--runs" if m != args.engine_model else "--engine-model", load_config, m)
            for _, m in runs
        }
        block = args.engine_block_size
        if block is None:  # one slice for every run: V4-Flash needs blocks of 128
            block = V4_BLOCK_SIZE if any(not c.is_v41 for c in models.values()) else DEFAULT_BLOCK_SIZE // 4
        if not (math.isfinite(block) and block >= 1):
            raise ValueError(f"--engine-block-size must be a finite number >= 1, got {block}")
        for model, cfg in models.items():
            try:
                LayerPlan.from_config(cfg).check_block_size(block)
            except ValueError as exc:
                raise ValueError(f"--engine-block-size {block} for {model}: {exc}") from None
        configs = []
        for name, model in runs:  # each run once, in order
            policy = parse_flag("--runs", parse_policy, name)
            if policy.checkpoint_every is not None and policy.checkpoint_every % block:
                raise ValueError(
                    f"--runs: {name}: checkpoint period {policy.checkpoint_every} must be a multiple of the "
                    f"engine block size {block}"
                )
            cache = CacheOptions(
                kv_cache_memory=parse_bytes(args.kv_cache_memory),
                persistent_ttl_s=parse_duration(args.persistent_ttl),
                swa_pool_size=parse_bytes(args.swa_pool_size),
                swa_pool_ttl_s=parse_duration(args.swa_pool_ttl),
                policy=policy,
            )
            configs.append(
                EngineModeConfig(
                    model=model,
                    block_size=block,
                    max_requests=args.max_requests,
                    time_scale=args.time_scale,
                    cache=cache,
                    max_num_seqs=args.max_num_seqs,
                    seed=args.seed,
                    device=args.device,
                )
            )
        return configs
    base = SimConfig(
        model=args.model,
        device_bytes=parse_bytes(args.device_size),
        persistent_bytes=parse_bytes_or_unbounded(args.persistent_size),
        persistent_ttl_s=parse_duration(args.persistent_ttl),
        swa_pool_bytes=parse_bytes(args.swa_pool_size),
        swa_pool_ttl_s=parse_duration(args.swa_pool_ttl),
        swa_pool_supersede=args.swa_pool_supersede,
        global_pool_bytes=parse_bytes(args.global_pool_size),
        global_pool_ttl_s=parse_duration(args.global_pool_ttl),
        gpu=args.gpu,
        mfu=args.mfu,
        output_tok_s=args.output_tok_s,
    )
    try:
        check_gpu(base.gpu, base.mfu)
    except ValueError as exc:
        raise ValueError(f"{'--mfu' if base.gpu in GPU_FP8_FLOPS else '--gpu'}: {exc}") from None
    runs = [parse_flag("--runs", lambda n: parse_run(n, base), n) for n in names]
    for i, (cfg, name) in enumerate(zip(runs, names, strict=True)):  # one run spelled two ways runs once
        if cfg in runs[:i]:
            raise ValueError(f"--runs: {name} is {names[runs.index(cfg)]} again")
    texts = args.sweep if args.sweep is not None else [DEFAULT_TTL_SWEEP, DEFAULT_SUPERSEDE_SWEEP]
    if "none" in texts and len(texts) > 1:
        raise ValueError("--sweep none runs no sweep: it cannot be combined with another --sweep")
    sweeps = (
        []
        if texts == ["none"]
        else [
            (
                parse_flag("--sweep", parse_sweep, t),
                parse_flag("--sweep-run", lambda n: parse_run(n, base), args.sweep_run),
            )
            for t in texts
        ]
    )
    named = [("--runs", r.model, n) for r, n in zip(runs, names, strict=True)]
    named += [("--sweep-run", c.model, args.sweep_run) for _, c in sweeps]
    for flag, model in dict.fromkeys((f if "@" in n else "--model", m) for f, m, n in named):
        parse_flag(flag, load_config, model)  # an unknown model fails before the trace is read
    if args.mode == "stats":
        return None
    return runs, sweeps


def _check_report_dir(path: Path) -> None:
    """Refuse, before any run, a report path that is a file, whose parent folder does not exist (the report's
    folder is made, not a tree of them: a mistyped path makes nothing), or under no writable directory: a folder
    is made in it and removed at once (``.kvdiet-report-check-*``); the report's own folder is made by the report
    writer once the runs succeed."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"--report {path}: exists and is not a directory")
    parent = path if path.exists() else path.absolute().parent
    if not parent.exists():
        raise ValueError(
            f"--report {path}: {parent} does not exist (the report's own folder is made, not its parents)"
        )
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--report {path}: {parent} is not a writable directory")
    try:  # where access() says yes and the file system says no (/proc, a read-only mount for root): a folder made
        os.rmdir(tempfile.mkdtemp(prefix=".kvdiet-report-check-", dir=parent))  # and removed at once
    except OSError as exc:
        raise ValueError(
            f"--report {path}: {parent} does not take a new folder (the file system refused one: "
            f"{(exc.strerror or str(exc)).lower()})"
        ) from None
