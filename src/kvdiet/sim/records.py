"""What a model-free simulation takes and gives: `SimConfig` (one simulated serving instance) and `SimResult`
(totals, series and the per-request `kvdiet.cache.plan.Provenance` of a run).
Plain data; the run itself is `kvdiet.sim.model_free.simulate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdiet.cache.options import DEFAULT_GLOBAL_POOL_TTL_S
from kvdiet.cache.plan import Provenance
from kvdiet.cache.policies import BoundedReplay, SwaPolicy
from kvdiet.config import ModelConfig, load_config
from kvdiet.sim.cost import check_gpu
from kvdiet.sim.reblock import engine_block_size

__all__ = ["DEFAULT_DEVICE_BYTES", "DEFAULT_SWA_POOL_BYTES", "SimConfig", "SimResult"]

DEFAULT_DEVICE_BYTES = 32 * 10**9
"""32 GB of global KV: a deliberately modest device pool (a quarter of one H200) so the lower tiers work."""
DEFAULT_SWA_POOL_BYTES = 200 * 10**9
"""10% of a DGX H200's 2 TB of host memory (DESIGN.md §1: 10% of each machine's DRAM)."""


@dataclass(frozen=True)
class SimConfig:
    """One simulated serving instance.

    Attributes:
        model: preset or config path whose byte geometry and FLOPs are used.
        policy: the SWA policy.
        device_bytes: device-pool budget for global KV (bytes).
        persistent_bytes: persistent-tier budget (bytes; None = unbounded).
        persistent_ttl_s: persistent-tier TTL (seconds; default 72 h).
        swa_pool_bytes / swa_pool_ttl_s: SWA-pool budget (bytes) and TTL (seconds).
        swa_pool_supersede: a session's newer pool snapshot replaces its older ones
            (`kvdiet.cache.control.ControlPlane` ``supersede``).
        global_pool_bytes / global_pool_ttl_s: the shared global-KV DRAM tier between the device pool and the
            persistent tier: budget (bytes; 0 = no such tier, the default) and TTL (seconds; default 1 h).
        prefix_caching: look prompts up at all (off: every request cold).
        gpu / mfu: the compute cost model (`kvdiet.sim.cost`).
        output_tok_s: decode speed of one request (tokens/s) that sets when it finishes.
        samples: points of the time series (hit rate and resident bytes over trace time).
    """

    model: str = "deepseek-v4.1-flash"
    policy: SwaPolicy = field(default_factory=BoundedReplay)
    device_bytes: int = DEFAULT_DEVICE_BYTES
    persistent_bytes: int | None = None
    persistent_ttl_s: float = 72 * 3600.0
    swa_pool_bytes: int = DEFAULT_SWA_POOL_BYTES
    swa_pool_ttl_s: float = 300.0
    swa_pool_supersede: bool = False
    global_pool_bytes: int = 0
    global_pool_ttl_s: float = DEFAULT_GLOBAL_POOL_TTL_S
    prefix_caching: bool = True
    gpu: str = "h200"
    mfu: float = 0.5
    output_tok_s: float = 50.0
    samples: int = 120

    def check(self, block_size: int) -> ModelConfig:
        """Load and check the config against a trace's block size; returns the config.

        Raises:
            ValueError: a non-positive size or TTL (a negative global-pool size), a checkpoint period that
                is not a multiple of the block size the model runs at (`kvdiet.sim.reblock.engine_block_size`),
                or a dense config.
        """
        if self.device_bytes <= 0 or self.swa_pool_bytes <= 0:
            raise ValueError("device and SWA-pool sizes must be > 0 bytes")
        if self.persistent_bytes is not None and self.persistent_bytes <= 0:
            raise ValueError("persistent size must be > 0 bytes")
        if self.global_pool_bytes < 0 or not self.global_pool_ttl_s > 0:
            raise ValueError("global-pool size must be >= 0 bytes (0: none) and its TTL > 0")
        if not (self.persistent_ttl_s > 0 and self.swa_pool_ttl_s > 0 and self.output_tok_s > 0):
            raise ValueError("TTLs and output_tok_s must be > 0")
        check_gpu(self.gpu, self.mfu)
        if self.samples < 2:
            raise ValueError(f"samples must be >= 2, got {self.samples}")
        cfg = load_config(self.model)
        if not isinstance(cfg, ModelConfig):
            raise ValueError(f"{self.model}: the trace study needs a V4-family config (window and tiers)")
        k, bs = self.policy.checkpoint_every, engine_block_size(cfg, block_size)
        if k is not None and k % bs:
            raise ValueError(
                f"run {self.policy}@{self.model}: checkpoint period {k} must be a multiple of the block size "
                f"{bs} it runs at (e.g. checkpoint:{max(1, round(k / bs)) * bs})"
            )
        return cfg

    @property
    def has_global_pool(self) -> bool:
        """Whether the run has a global-KV DRAM tier (``global_pool_bytes`` > 0)."""
        return self.global_pool_bytes > 0

    @property
    def label(self) -> str:
        """``policy @ model``, e.g. ``bounded-replay @ deepseek-v4.1-flash``."""
        return f"{self.policy} @ {self.model}"

    @property
    def run_name(self) -> str:
        """``policy@model`` as ``--runs`` takes it (the model's full name), e.g. ``bounded-replay@deepseek-v4.1-flash``;
        the terminal's table prints it so that a row's name can be given back."""
        return f"{self.policy}@{self.model}"


@dataclass
class SimResult:
    """Totals, time series and the per-request sequence of one simulated run (`simulate`)."""

    config: SimConfig
    summary: dict[str, object]
    series: dict[str, list[float]]
    requests: list[Provenance]
    snapshot_ages_s: list[float]

    def as_dict(self) -> dict[str, object]:
        """The JSON form: the label, the config, the summary and the time series (not per request). The
        global pool's settings appear only when the run has one."""
        cfg = self.config
        pool = (
            {"global_pool_bytes": cfg.global_pool_bytes, "global_pool_ttl_s": cfg.global_pool_ttl_s}
            if cfg.has_global_pool
            else {}
        )
        return {
            "label": cfg.label,
            "model": cfg.model,
            "policy": str(cfg.policy),
            "config": {
                "device_bytes": cfg.device_bytes,
                "persistent_bytes": cfg.persistent_bytes,
                "persistent_ttl_s": cfg.persistent_ttl_s,
                "swa_pool_bytes": cfg.swa_pool_bytes,
                "swa_pool_ttl_s": cfg.swa_pool_ttl_s,
                "swa_pool_supersede": cfg.swa_pool_supersede,
                **pool,
                "prefix_caching": cfg.prefix_caching,
                "gpu": cfg.gpu,
                "mfu": cfg.mfu,
                "output_tok_s": cfg.output_tok_s,
            },
            "summary": self.summary,
            "series": self.series,
        }
