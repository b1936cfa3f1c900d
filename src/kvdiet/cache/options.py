"""`CacheOptions`: sizes, TTLs and SWA policy of the cache system, as plain data (no torch, no I/O), so the
command line can build and check them without loading the model.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path

from kvdiet.cache.policies import BoundarySnapshot, BoundedReplay, SwaPolicy, parse_policy
from kvdiet.layer_plan import DEFAULT_BLOCK_SIZE, V4_BLOCK_SIZE
from kvdiet.setting_error import SettingError
from kvdiet.units import is_unbounded, parse_bytes, parse_duration

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_GLOBAL_POOL_TTL_S",
    "DEFAULT_PERSISTENT_TTL_S",
    "DEFAULT_SWA_POOL_TTL_S",
    "IN_PROCESS",
    "CacheOptions",
]

DEFAULT_PERSISTENT_TTL_S = 72 * 3600.0
"""Global KV is kept at least 72 hours (seed 001, DESIGN.md §1)."""

DEFAULT_SWA_POOL_TTL_S = 300.0
"""5 minutes: the SWA pool's TTL "of minutes" (DESIGN.md §1, seed 001)."""

DEFAULT_GLOBAL_POOL_TTL_S = 3600.0
"""1 hour: the shared global-KV DRAM tier's TTL, long enough for the sessions and shared system prompts other
machines continue, short against the persistent tier's 72 h (the durable copy)."""

IN_PROCESS = "in-process"
"""The ``--swa-pool`` value of the default backend, `kvdiet.storage.swa_pool.InProcessSwaPool`."""


@dataclass(frozen=True, slots=True)
class CacheOptions:
    """Sizes, TTLs and policy of a `ModelRunner` (the ``--kv-cache-memory``, ``--persistent-*``, ``--swa-*``,
    ``--global-pool*`` flags).

    Attributes:
        kv_cache_memory: device-pool budget in bytes; the pool holds ``budget // block_bytes`` blocks.
        block_size: tokens per block (a multiple of every compress ratio); None: the model's default
            (`for_model`: 64 for V4.1, 128 for V4-Flash).
        persistent_dir: directory of the persistent tier (None: no persistent tier).
        persistent_ttl_s / persistent_size: TTL in seconds and byte capacity (None or ``"unbounded"``: unbounded).
        persistent_read_only: read the persistent tier and never write it (`kvdiet.storage.persistent`).
        swa_pool: the SWA-pool backend (``--swa-pool``): ``"in-process"`` (default), Redis URLs, one or
            comma-separated, or ``mooncake://HOST:PORT`` (`kvdiet.storage.swa_pool_factory.create_swa_pool`).
        swa_pool_size / swa_pool_ttl_s: SWA-pool budget in bytes (None: 10% of host RAM; the in-process pool's
            budget or the segment this process gives a Mooncake pool, 0 for none; a Redis server's budget is its
            ``maxmemory``) and TTL in seconds.
        global_pool: the shared global-KV DRAM tier (``--global-pool mooncake://HOST[:PORT]``), read after the
            device pool and before the persistent tier, written through like it (None: none).
        global_pool_size / global_pool_ttl_s: the segment this process gives the global pool in bytes (None:
            10% of host RAM; 0: none) and its TTL in seconds.
        policy: the SWA policy (DESIGN.md §5): a `SwaPolicy`, or its ``--swa-policy`` name as a string
            (``"full-store"``, ``"checkpoint:1024"``; parsed by `kvdiet.cache.policies.parse_policy`, whose
            ValueError it raises); None: the model's default (`for_model`: bounded-replay for V4.1,
            boundary-snapshot for V4-Flash).
        decoder_replay: run decoder layers only on each prefill chunk's last W rows (v41-spec §7.1);
            forced off under ``full-store``, which keeps every token's window entries.
        prefix_caching: look prompts up at all (False: every request is cold; blocks are still written).
        cache_salt: optional salt mixed into every block hash (tenant isolation).
    Sizes may be given as byte strings (``"1GB"``, `kvdiet.units.parse_bytes`) and TTLs as durations (``"5m"``,
    `kvdiet.units.parse_duration`), as the flags take them.

    Raises:
        SettingError: a size, block size or TTL out of range, or an empty ``persistent_dir`` (named by keyword;
            the command line names the flag). ValueError: a policy string `parse_policy` refuses.
        TypeError: a setting of the wrong type, or a policy neither a `SwaPolicy`, a string nor None.
    """

    kv_cache_memory: int = 1 << 30
    block_size: int | None = None
    persistent_dir: str | Path | None = None
    persistent_ttl_s: float = DEFAULT_PERSISTENT_TTL_S
    persistent_size: int | None = None
    persistent_read_only: bool = False
    swa_pool: str = IN_PROCESS
    swa_pool_size: int | None = None
    swa_pool_ttl_s: float = DEFAULT_SWA_POOL_TTL_S
    global_pool: str | None = None
    global_pool_size: int | None = None
    global_pool_ttl_s: float = DEFAULT_GLOBAL_POOL_TTL_S
    policy: SwaPolicy | str | None = None
    decoder_replay: bool = True
    prefix_caching: bool = True
    cache_salt: bytes | None = None

    def __post_init__(self) -> None:
        _check_sizes_and_ttls(self)
        if isinstance(self.policy, str):
            object.__setattr__(self, "policy", parse_policy(self.policy))
        elif self.policy is not None and not isinstance(self.policy, SwaPolicy):
            raise TypeError(
                f"policy must be a SwaPolicy, its name (e.g. 'full-store', parsed by parse_policy) or None, "
                f"got {self.policy!r}"
            )

    def for_model(self, *, v4_flash: bool) -> CacheOptions:
        """These options with ``block_size`` and ``policy`` left None set to the model's defaults, the ones
        ``kvdiet generate``, ``kvdiet serve`` and `kvdiet.LLM` all apply: V4.1 blocks of `DEFAULT_BLOCK_SIZE`
        (64) tokens and bounded replay; V4-Flash (``v4_flash``) blocks of `V4_BLOCK_SIZE` (128: its HCA entries
        span 128 tokens) and boundary snapshots, as its deployments keep window state. A given value is kept.
        """
        block_size = V4_BLOCK_SIZE if v4_flash else DEFAULT_BLOCK_SIZE
        policy = BoundarySnapshot() if v4_flash else BoundedReplay()
        return dataclasses.replace(
            self,
            block_size=block_size if self.block_size is None else self.block_size,
            policy=policy if self.policy is None else self.policy,
        )


def _check_sizes_and_ttls(opts: CacheOptions) -> None:
    """Check (and normalise: byte and duration strings become numbers, numpy's ints Python's) the sizes, block
    size, TTLs and folder of ``opts`` before anything uses them (a string budget failed deep in the pool; an
    empty folder put the persistent tier in the working directory). Raises as `CacheOptions` says."""

    def whole(name: str, value: object, low: int) -> None:
        if isinstance(value, str) and name != "block_size":
            try:
                value = parse_bytes(value)
            except ValueError as exc:
                raise SettingError(f"{{{name}}}: {{reason}}", reason=exc) from None
        if isinstance(value, bool) or not isinstance(value, Integral):  # numpy's ints too, kept as int
            kind = "an int (tokens)" if name == "block_size" else "an int (bytes) or a byte string like '1GB'"
            raise TypeError(f"{name} must be {kind}, got {value!r}")
        value = operator.index(value)
        object.__setattr__(opts, name, value)
        if value < low:
            raise SettingError(f"{{{name}}} must be >= {low}, got {value}")

    if is_unbounded(opts.persistent_size):  # exactly the default, as ``--persistent-size unbounded``
        object.__setattr__(opts, "persistent_size", None)
    whole("kv_cache_memory", opts.kv_cache_memory, 1)
    for name in ("block_size", "persistent_size", "swa_pool_size", "global_pool_size"):
        value = getattr(opts, name)
        if value is not None:
            whole(name, value, 1 if name == "block_size" else 0)
    if opts.persistent_size == 0:  # (a tier that keeps nothing, every write evicted at once)
        raise SettingError(
            "{persistent_size} must be > 0 bytes: a tier that keeps nothing is off ({persistent_dir} none)"
        )
    for name in ("persistent_ttl_s", "swa_pool_ttl_s", "global_pool_ttl_s"):
        value = getattr(opts, name)
        if isinstance(value, str):
            try:
                object.__setattr__(opts, name, parse_duration(value))
            except ValueError as exc:
                raise SettingError(f"{{{name}}}: {{reason}}", reason=exc) from None
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"{name} must be seconds (a number) or a duration like '5m', got {value!r}")
        elif not value > 0:
            raise SettingError(f"{{{name}}} must be > 0 seconds, got {value}")
    if opts.swa_pool_size == 0 and isinstance(opts.swa_pool, str) and opts.swa_pool.strip() == IN_PROCESS:
        raise SettingError(
            "{swa_pool_size} must be > 0 bytes for the in-process SWA pool (0 is for a Mooncake pool: no segment "
            "from this process), got 0"
        )
    folder = opts.persistent_dir
    if folder is not None and not isinstance(folder, str | Path):
        raise TypeError(f"persistent_dir must be a str or Path folder, or None, got {folder!r}")
    if folder is not None and not str(folder).strip():
        raise SettingError(
            "{persistent_dir} must name a folder (no persistent tier: None from Python, none on the command "
            "line), got {got}",
            got=repr(folder),
        )
