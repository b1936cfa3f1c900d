"""`EngineArgs`: every setting of an engine in one frozen value, and building the engine from it.

Shared by `kvdiet.LLM` (scripts) and ``kvdiet serve`` (the server); flag names follow vLLM's where the
meaning is the same (``--max-model-len``, ``--max-num-seqs``, ``--max-num-batched-tokens``,
``--enable-prefix-caching``, ``--kv-cache-dtype``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvdiet.engine.engine import EngineObserver, LLMEngine
from kvdiet.engine.generate import load_model
from kvdiet.engine.kv_cache import CacheOptions, KVCache
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
        model: preset name or V4.1 config path (``v4.1-mini``: real cache geometry, real tokenizer); None
            with ``weights``: the checkpoint's ``config.json``.
        seed: seed of the random weights (ignored with ``weights``).
        weights: a checkpoint (folder or safetensors file, `kvdiet.model.loader.load_checkpoint`), or None
            for seeded random weights.
        numerics: ``auto``, ``fp8`` or ``bf16``: how FP8/FP4-stored weights compute (`kvdiet.model.loader`).
        expert_cache_bytes: routed-expert bytes kept in memory with ``weights`` (None: automatic).
        kv_cache_dtype: ``auto``/``fp4`` (packed formats) or ``fp32`` (unquantised).
        cache: device pool, prefix cache, tiers and SWA policy.
        max_model_len: longest prompt + output in tokens (None: the config's ``max_position_embeddings``).
        scheduler: batching limits.
    Raises:
        ValueError: an unknown ``kv_cache_dtype``.
    """

    model: str | None = "v4.1-mini"
    seed: int = 0
    weights: str | Path | None = None
    numerics: str = "auto"
    expert_cache_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    cache: CacheOptions = field(default_factory=CacheOptions)
    max_model_len: int | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )

    def create_engine(
        self, *, observer: EngineObserver | None = None, swa_pool: SwaPool | None = None
    ) -> LLMEngine:
        """Load the model and tokenizer, open the cache system (persistent tier, SWA pool) and build the
        engine. The caller closes it with ``engine.cache.close()``.

        Raises:
            ConfigError, WeightsError, ValueError: a bad model, weights or setting (nothing left open).
        """
        model, tokenizer = load_model(
            self.model,
            seed=self.seed,
            weights=self.weights,
            exact=KV_CACHE_DTYPES[self.kv_cache_dtype],
            numerics=self.numerics,
            expert_cache_bytes=self.expert_cache_bytes,
        )
        cache = KVCache(
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
