"""The cache-system flags of ``kvdiet generate`` and ``kvdiet serve`` (the device pool, prefix caching, the
persistent, SWA and global tiers, the SWA policy): added to a parser by `add_cache_args`, read back into
`kvdiet.cache.options.CacheOptions` by `cache_options`, every value checked from the config alone, each error named
by its flag (`kvdiet.engine.args.EngineArgs` calls both)."""

from __future__ import annotations

import argparse
import logging
from functools import partial
from pathlib import Path

from kvdiet.cache.options import CacheOptions
from kvdiet.cache.policies import parse_policy
from kvdiet.config import ModelConfig, load_config
from kvdiet.layer_plan import LayerPlan
from kvdiet.storage.folders import check_folder
from kvdiet.storage.mooncake_urls import check_mooncake_spec
from kvdiet.storage.swa_pool_factory import check_swa_pool_spec
from kvdiet.units import parse_bytes, parse_bytes_or_unbounded, parse_duration, parse_flag

__all__ = ["add_cache_args", "cache_options"]

_log = logging.getLogger("kvdiet.engine")


def add_cache_args(group: argparse._ArgumentGroup, *, persistent_default: str | None = None) -> None:
    """The cache-system flags of ``generate`` and ``serve`` (read back by `cache_options`)."""
    group.add_argument(
        "--kv-cache-memory", default="1GiB", help="device-pool budget for global KV (default 1GiB)"
    )
    group.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per block (default 64 for V4.1; 128 for V4-Flash, whose HCA entries span 128 tokens)",
    )
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
    group.add_argument(
        "--persistent-read-only",
        action="store_true",
        help="read the persistent tier's folder and never write it: a snapshot shared read-only, its entries "
        "served, nothing stored (a folder this process may not write is read so anyway, with a warning)",
    )
    group.add_argument(
        "--persistent-ttl",
        help="persistent-tier TTL of the entries this process writes, from their writing (default 72h); an entry "
        "keeps the TTL it was written with: a shorter one later does not expire older entries",
    )
    group.add_argument(
        "--persistent-size",
        help="persistent-tier capacity, LRU beyond it (default unbounded; 'unbounded' says so); of the whole "
        "folder: each process sharing it evicts the least recently read entries, any process's, down to its own "
        "limit, so give them one value",
    )
    group.add_argument(
        "--swa-policy",
        default=None,
        help="bounded-replay (the default for V4.1), boundary-snapshot (the default for V4-Flash, as its "
        "deployments keep window state), full-store, checkpoint:K, exact-recompute",
    )
    group.add_argument(
        "--swa-pool",
        default="in-process",
        help="where window snapshots live: in-process (default; dies with the process), "
        "redis://HOST:PORT/DB, several such URLs separated by commas (keys sharded over them), or "
        "redis+cluster://HOST:PORT (a Redis Cluster), or mooncake://HOST:PORT (a Mooncake Store master; "
        "the kvdiet[mooncake] extra); shared by every process that names it",
    )
    group.add_argument(
        "--swa-pool-size",
        help="in-process SWA-pool budget, or the segment this process gives a Mooncake pool (0: none) "
        "(default 10%% of host RAM; Redis: its maxmemory)",
    )
    group.add_argument("--swa-pool-ttl", default="5m", help="SWA-pool TTL, any backend (default 5m)")
    group.add_argument(
        "--global-pool",
        help="shared global-KV DRAM tier, mooncake://HOST[:PORT] (a Mooncake Store master; the kvdiet[mooncake] "
        "extra): read after the device pool and before the persistent tier, written through like it, so a prefix "
        "computed on one machine hits on another (default: none)",
    )
    group.add_argument(
        "--global-pool-size",
        help="the segment this process gives the global pool (default 10%% of host RAM; 0: none)",
    )
    group.add_argument("--global-pool-ttl", help="global-pool TTL (default 1h)")
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="look prompts up in the cache tiers (default on; blocks are written either way)",
    )
    group.add_argument(
        "--no-decoder-replay",
        action="store_true",
        help="run the decoder layers on every prompt row instead of the last window (exact, slower)",
    )


def cache_options(args: argparse.Namespace) -> CacheOptions:
    """`CacheOptions` from the flags of `add_cache_args` and ``--model``. Raises ValueError on a bad value, named
    by its flag, and ConfigError on a bad model (from the config alone: before the model loads and before
    anything is opened or connected)."""
    cfg = load_config(args.model)
    if isinstance(cfg, ModelConfig) and args.block_size is not None:  # before the model loads (seconds+)
        parse_flag("--block-size", LayerPlan.from_config(cfg).check_block_size, args.block_size)
    pool_flags = {"--global-pool-size": args.global_pool_size, "--global-pool-ttl": args.global_pool_ttl}
    if args.global_pool is None and (given := [flag for flag, value in pool_flags.items() if value]):
        raise ValueError(f"{given[0]}: no --global-pool is given (mooncake://HOST[:PORT])")
    # none in any case (NONE made a folder of that name); a folder given on the command line that cannot be used
    # is an error; the default one (serve's) gets one warning naming why, and the tier is off
    persistent = None if str(args.persistent_dir).lower() == "none" else args.persistent_dir
    check = partial(check_folder, writes=not args.persistent_read_only)
    off = (
        "the persistent tier is off (--persistent-dir none)"
        if args.persistent_dir
        else "no --persistent-dir is given"
    )
    fell_back = False  # the default folder could not be used (warned of; its tier's other settings go unused)
    if persistent is not None and persistent != getattr(args, "persistent_default", None):
        parse_flag("--persistent-dir", check, persistent)
    elif persistent is not None:
        try:
            check(persistent)
        except ValueError as exc:
            _log.warning("the default --persistent-dir cannot be used: %s; the persistent tier is off", exc)
            persistent, off, fell_back = None, "the default --persistent-dir cannot be used", True
    if args.persistent_read_only and (persistent is None or not Path(persistent).expanduser().is_dir()):
        what = f"{persistent!r} is no folder to read" if persistent else off
        raise ValueError(f"--persistent-read-only: {what}")
    ttl = parse_flag("--persistent-ttl", parse_duration, args.persistent_ttl or "72h")
    size = parse_flag("--persistent-size", parse_bytes_or_unbounded, args.persistent_size)
    # the tier's settings where the command line turned it off, or gave it no folder, were ignored: refused
    tier_flags = {"--persistent-ttl": args.persistent_ttl, "--persistent-size": args.persistent_size}
    given = [flag for flag, value in tier_flags.items() if value is not None]
    if persistent is None and given and not fell_back:
        raise ValueError(f"{given[0]}: {off}")
    return CacheOptions(
        kv_cache_memory=parse_flag("--kv-cache-memory", parse_bytes, args.kv_cache_memory),
        block_size=args.block_size,  # None: the model's (for_model)
        persistent_dir=persistent,
        persistent_ttl_s=ttl,
        persistent_size=size,
        persistent_read_only=args.persistent_read_only,
        swa_pool=check_swa_pool_spec(args.swa_pool),
        swa_pool_size=parse_flag("--swa-pool-size", _bytes_or_none, args.swa_pool_size),
        swa_pool_ttl_s=parse_flag("--swa-pool-ttl", parse_duration, args.swa_pool_ttl),
        global_pool=None
        if args.global_pool is None
        else check_mooncake_spec(args.global_pool, flag="--global-pool"),
        global_pool_size=parse_flag("--global-pool-size", _bytes_or_none, args.global_pool_size),
        global_pool_ttl_s=parse_flag("--global-pool-ttl", parse_duration, args.global_pool_ttl or "1h"),
        policy=None if args.swa_policy is None else parse_flag("--swa-policy", parse_policy, args.swa_policy),
        decoder_replay=not args.no_decoder_replay,
        prefix_caching=args.enable_prefix_caching,
    ).for_model(v4_flash=isinstance(cfg, ModelConfig) and not cfg.is_v41)


def _bytes_or_none(value: str | None) -> int | None:
    """A size whose default is computed (None: 10% of RAM), not unbounded: ``unbounded`` is refused."""
    return parse_bytes(value) if value else None
