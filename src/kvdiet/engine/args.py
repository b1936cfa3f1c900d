"""`EngineArgs`: every setting of an engine in one frozen value, its command-line flags, and building the
engine from it.

Shared by `kvdiet.LLM` (scripts), ``kvdiet generate`` and ``kvdiet serve``; as vLLM's, the flags are added by
`EngineArgs.add_cli_args` and read back by `EngineArgs.from_cli_args`. Flag names follow vLLM's where the
meaning is the same (``--max-model-len``, ``--max-num-seqs``, ``--max-num-batched-tokens``,
``--enable-prefix-caching``, ``--kv-cache-dtype``). Importing this module loads no torch (the command line
builds its parser from it); the model and the engine are imported when an engine is built.
"""

from __future__ import annotations

import argparse
import operator
from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path
from typing import TYPE_CHECKING

from kvdiet.cache.options import CacheOptions
from kvdiet.config import NUMERICS, ModelConfig, load_config, model_config_path
from kvdiet.engine.cache_args import add_cache_args, cache_options
from kvdiet.engine.pool_specs import check_pool_specs
from kvdiet.engine.weights_args import add_weights_args, expert_cache_bytes, resolve_model
from kvdiet.layer_plan import LayerPlan
from kvdiet.setting_error import SettingError
from kvdiet.units import parse_count, parse_flag

if TYPE_CHECKING:
    from kvdiet.engine.engine import EngineObserver, LLMEngine
    from kvdiet.engine.scheduler import SchedulerConfig
    from kvdiet.storage.swa_pool import SwaPool

__all__ = ["KV_CACHE_DTYPES", "EngineArgs"]

KV_CACHE_DTYPES = {
    "auto": False,  # the model's packed formats: FP4 main KV, MXFP4 index keys, FP8 window (v41-spec §4)
    "fp4": False,  # the same, named
    "fp32": True,  # unquantised fp32 caches (the exactness tests' mode; ~9× the bytes)
}
"""``--kv-cache-dtype`` value → whether the caches are unquantised (``exact``)."""


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """What to load and how to run it.

    Attributes:
        model: preset name or V4.1 / V4-Flash config path (``v4.1-mini``: real cache geometry, real tokenizer); None
            with ``weights``: the checkpoint's ``config.json``.
        seed: seed of the random weights (ignored with ``weights``): an int in [-2**63, 2**64) (numpy's too), or
            None for the default 0.
        weights: a checkpoint (folder or safetensors file, `kvdiet.model.loader.load_checkpoint`), or None
            for seeded random weights.
        numerics: ``auto``, ``fp8`` or ``bf16``: how FP8/FP4-stored weights compute (`kvdiet.model.loader`).
        expert_cache_bytes: routed-expert bytes kept in memory with ``weights`` (None: automatic).
        kv_cache_dtype: ``auto``/``fp4`` (packed formats) or ``fp32`` (unquantised).
        cache: device pool, prefix cache, tiers and SWA policy; a block size or policy left None is the model's
            default (`CacheOptions.for_model`, applied by `validate` and `create_engine`, as on the command line).
        max_model_len: longest prompt + output in tokens (None: the config's ``max_position_embeddings``).
        scheduler: batching limits.
        device: where the model, its device pool and request state live: ``cpu``, ``cuda`` or ``cuda:N``
            (`kvdiet.device`).
    Raises:
        ValueError: an unknown ``kv_cache_dtype`` (a `SettingError`: keywords in ``str()``, flags in
            ``as_flags()``), a ``seed`` outside [-2**63, 2**64).
        TypeError: a ``seed`` that is not an int (bools, floats and strings too) or None.
    """

    model: str | None = "v4.1-mini"
    seed: int | None = 0
    weights: str | Path | None = None
    numerics: str = "auto"
    expert_cache_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    cache: CacheOptions = field(default_factory=CacheOptions)
    max_model_len: int | None = None
    scheduler: SchedulerConfig = field(default_factory=lambda: _default_scheduler())
    device: str = "cpu"

    def __post_init__(self) -> None:
        seed = 0 if self.seed is None else self.seed
        if not isinstance(seed, Integral) or isinstance(seed, bool):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        if not -(2**63) <= seed < 2**64:  # torch.manual_seed's range
            raise ValueError(f"seed must be in [-2**63, 2**64), got {seed}")
        object.__setattr__(self, "seed", operator.index(seed))
        # numerics is checked with or without weights (random ones ignore it)
        for name, known in (("kv_cache_dtype", KV_CACHE_DTYPES), ("numerics", NUMERICS)):
            if (value := getattr(self, name)) not in known:
                raise SettingError(
                    f"{{{name}}} must be one of {', '.join(known)}, got {{got}}", got=repr(value)
                )
        check_pool_specs(self.cache)
        if (size := self.expert_cache_bytes) is not None:
            if isinstance(size, bool) or not isinstance(size, Integral):
                raise TypeError(f"expert_cache_bytes must be an int (bytes) or None, got {size!r}")
            object.__setattr__(self, "expert_cache_bytes", operator.index(size))  # numpy's ints too, as int
            if size < 0:
                raise SettingError(f"{{expert_cache_bytes}} must be >= 0 bytes, got {size}")

    @staticmethod
    def add_cli_args(
        parser: argparse.ArgumentParser, *, persistent_default: str | None = None
    ) -> argparse.ArgumentParser:
        """Add the weights flags (``--weights``, ``--numerics``, ``--expert-cache-size``), ``--max-model-len``,
        ``--kv-cache-dtype`` and the cache-system group (``--kv-cache-memory``, ``--block-size``,
        ``--persistent-*``, ``--swa-*``, prefix caching) to ``parser``; ``persistent_default`` is
        ``--persistent-dir``'s default (None: no persistent tier). Returns ``parser``."""
        add_weights_args(parser)
        parser.add_argument(
            "--max-model-len",
            help="longest prompt + output in tokens, e.g. 32K; one request of it must fit --kv-cache-memory "
            "in ceil(N / --block-size) blocks (default: the config's max_position_embeddings)",
        )
        parser.add_argument(
            "--kv-cache-dtype",
            default="auto",
            choices=list(KV_CACHE_DTYPES),
            help="auto/fp4 (default): the packed V4.1 formats (FP4 KV, MXFP4 index keys, FP8 window); "
            "fp32: unquantised caches (~9x the bytes)",
        )
        add_cache_args(parser.add_argument_group("cache system"), persistent_default=persistent_default)
        parser.set_defaults(persistent_default=persistent_default)  # a folder other than it was given
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **fields: object) -> EngineArgs:
        """The arguments the flags of `add_cli_args` plus ``--model`` and ``--seed`` give (``args.model`` is
        resolved in place, `resolve_model`); ``fields`` sets the rest (``scheduler``). Checks every flag from
        the config alone: nothing is loaded, opened or connected.

        Raises:
            ValueError: a bad value, named by its flag. ConfigError: a bad model.
        """
        resolve_model(args)
        return cls(
            model=args.model,
            seed=args.seed,
            weights=args.weights,
            numerics=args.numerics,
            expert_cache_bytes=expert_cache_bytes(args),
            kv_cache_dtype=args.kv_cache_dtype,
            max_model_len=None
            if args.max_model_len is None
            else parse_flag("--max-model-len", parse_count, args.max_model_len),
            cache=cache_options(args),
            device=args.device,
            **fields,
        )

    def validate(self) -> None:
        """Every check that needs the config but not the weights: the block size, the KV-cache budget in
        blocks and on the CPU in the memory available (`check_kv_memory`), the checkpoint period and
        ``max_model_len`` against both. ``kvdiet serve`` runs it before it binds its port, so a bad flag is
        reported as itself even when the port is busy.

        Raises:
            ConfigError: a bad model. SettingError (a ValueError): a bad setting, one line, named as its keyword
                (``str()``) or its flag (``as_flags()``, which the command line prints).
        """
        from kvdiet.engine.max_model_len import check_max_model_len
        from kvdiet.engine.runner import pool_num_blocks
        from kvdiet.model.build import check_numerics

        check_numerics(self.numerics, self.weights)  # load_model's own refusal, before anything loads
        geometry = self.check_kv_memory()
        if geometry is None:
            return  # create_engine refuses the model with its own message
        limit, cache, block_bytes = geometry
        check_max_model_len(
            self.max_model_len,
            limit=limit,
            block_size=cache.block_size,
            num_blocks=pool_num_blocks(cache, block_bytes),
            block_bytes=block_bytes,
        )

    def check_kv_memory(self) -> tuple[int, CacheOptions, int] | None:
        """The block size, the KV-cache budget in blocks and, on the CPU, in this machine's available memory with
        the random weights beside it (a GPU's pool lies on the GPU; a checkpoint's weights are checked as they
        load). Returns ``(max_position_embeddings, the model's cache options, bytes a block)``, or None for a
        config that is no V4-family model's.

        Raises:
            ConfigError, SettingError: as `validate`.
        """
        from kvdiet.engine.runner import pool_num_blocks
        from kvdiet.formats.codec import CacheCodecs
        from kvdiet.model.memory import (
            InsufficientMemoryError,
            available_memory_bytes,
            check_fits,
            random_weights_bytes,
        )
        from kvdiet.model.paged_pool import DevicePool

        cfg = self._config()
        if not isinstance(cfg, ModelConfig):
            return None
        cache = self.cache.for_model(v4_flash=not cfg.is_v41)
        plan, bs = LayerPlan.from_config(cfg), cache.block_size
        try:
            plan.check_block_size(bs)
        except ValueError as exc:
            raise SettingError("{block_size}: {reason}", reason=exc) from None
        exact = KV_CACHE_DTYPES[self.kv_cache_dtype]
        if cfg.is_v41:
            codecs = CacheCodecs.for_dims(cfg.head_dim, cfg.index_head_dim, exact=exact)
        else:
            codecs = CacheCodecs.for_v4(cfg.head_dim, cfg.index_head_dim, cfg.qk_rope_head_dim, exact=exact)
        ratios = {s: plan[s].compress_ratio for s in plan.kv_sources}
        indexed = frozenset(s for s in plan.kv_sources if plan[s].owns_index_keys)
        block_bytes = DevicePool(ratios, codecs, block_size=bs, num_blocks=1, indexed=indexed).block_bytes
        if self.device == "cpu":  # with the random weights (a checkpoint's are checked as it loads)
            kv = pool_num_blocks(cache, block_bytes) * block_bytes
            weights = random_weights_bytes(cfg) if self.weights is None else 0
            have = available_memory_bytes()
            what = "the KV cache" + (" with the model's random weights" if weights else "")
            try:  # weights that cannot fit alone: the model's own refusal names them as it loads
                check_fits(what, kv + weights if weights <= have else kv, have=have)
            except InsufficientMemoryError as exc:
                raise SettingError("{kv_cache_memory}: {reason}", reason=exc) from None
        return cfg.max_position_embeddings, cache, block_bytes

    def create_engine(
        self, *, observer: EngineObserver | None = None, swa_pool: SwaPool | None = None
    ) -> LLMEngine:
        """Load the model and tokenizer, open the cache system (persistent tier, SWA pool) and build the
        engine, after `validate` (so a bad setting is refused before the model loads). The caller closes it
        with ``engine.runner.close()``.

        Raises:
            ConfigError, WeightsError, ValueError: a bad model, weights or setting (nothing left open).
        """
        from kvdiet.engine.engine import LLMEngine
        from kvdiet.engine.runner import ModelRunner
        from kvdiet.model.build import load_model

        self.validate()
        model, tokenizer = load_model(
            self.model,
            seed=self.seed,
            weights=self.weights,
            exact=KV_CACHE_DTYPES[self.kv_cache_dtype],
            numerics=self.numerics,
            expert_cache_bytes=self.expert_cache_bytes,
            device=self.device,
        )
        cache = ModelRunner(
            model, self.cache, tokenizer_id=tokenizer.identity if tokenizer else "none", swa_pool=swa_pool
        )
        engine = LLMEngine(
            model,
            cache,
            tokenizer=tokenizer,
            max_model_len=self.max_model_len,
            scheduler=self.scheduler,
            observer=observer,
        )
        cache.open()
        return engine

    def _config(self) -> object:
        """The model's config (`load_config`): ``model``'s, else the one beside ``weights``, else v4.1-mini's;
        None for ``weights`` without one (`load_model` refuses them, naming ``model``)."""
        name = self.model if self.model is not None else model_config_path(self.weights)
        if name is None and self.weights is not None:
            return None
        return load_config(str(name) if name is not None else "v4.1-mini")


def _default_scheduler() -> SchedulerConfig:
    from kvdiet.engine.scheduler import SchedulerConfig  # torch-free command line: loaded with the engine

    return SchedulerConfig()
