"""The planner's report: layer plan, bytes per token, window state, totals, SWA policies, capacity.

Everything here is addition over `kvdiet.cache.spec.CacheSpec` and `kvdiet.cache.policies.SwaPolicy`; the
planner defines no byte count of its own. The report is a plain JSON-able dict (what ``kvdiet plan
--json`` prints); `kvdiet.planner.render` turns it into tables.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

from kvdiet.cache.options import CacheOptions
from kvdiet.cache.policies import parse_policy
from kvdiet.cache.spec import CacheSpec
from kvdiet.config import DenseConfig, ModelConfig
from kvdiet.layer_plan import LayerPlan
from kvdiet.units import format_gb
from kvdiet.weights import estimate_weights

__all__ = ["GPUS", "PlanOptions", "all_full_config", "compare_reports", "plan_report"]

# Named devices, memory in decimal GB as the vendors quote it (SXM parts); the same names as the trace
# study's cost model (`kvdiet.sim.cost.GPU_FP8_FLOPS`), so ``plan --gpu`` and ``replay --gpu`` agree.
GPUS: dict[str, float] = {"h100": 80.0, "h200": 141.0, "b200": 192.0}


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """Planner inputs (all sizes in tokens or decimal GB).

    Attributes:
        contexts: context lengths for the totals table.
        capacity_context: context of one session in the capacity estimate.
        gpu: a `GPUS` name, or ``"custom"`` when ``gpu_mem_gb`` was given.
        gpu_mem_gb: memory of one device.
        num_gpus: devices sharing the weights and the cache (any count whose bytes in all,
            ``num_gpus × gpu_mem_gb × 1e9``, are a finite float64: the sizes are float GB).
        weights_gb: device weight bytes; None → `kvdiet.weights.estimate_weights`.
        tokens_per_boundary: tokens between prompt/output ends, to amortise ``boundary-snapshot``.
        checkpoint_every: K of the ``checkpoint:K`` row.
    Raises:
        ValueError: a value out of range, named by its field first (``num_gpus must be > 0, got 0``).
    """

    contexts: tuple[int, ...] = (4_000, 128_000, 1_000_000)
    capacity_context: int = 128_000
    gpu: str = "h200"
    gpu_mem_gb: float = GPUS["h200"]
    num_gpus: int = 8
    weights_gb: float | None = None
    tokens_per_boundary: int = 1024
    checkpoint_every: int = 4096

    def __post_init__(self) -> None:
        if self.num_gpus <= 0:
            raise ValueError(f"num_gpus must be > 0, got {self.num_gpus}")
        if not (math.isfinite(self.gpu_mem_gb * 1e9) and self.gpu_mem_gb > 0):
            raise ValueError(
                f"gpu_mem_gb must be a finite number > 0 (finite in bytes), got {self.gpu_mem_gb}"
            )
        if round(self.gpu_mem_gb * 1e9) * self.num_gpus > sys.float_info.max:
            n = self.num_gpus
            count = f"{n:,}" if n < 10**30 else f"a {len(str(n))}-digit count"
            raise ValueError(
                f"num_gpus × gpu_mem_gb is past the largest float64 ({sys.float_info.max:.3g} bytes), "
                f"got {count} × {self.gpu_mem_gb:g} GB"
            )
        if self.weights_gb is not None and not (
            math.isfinite(self.weights_gb * 1e9) and self.weights_gb >= 0
        ):
            raise ValueError(
                f"weights_gb must be a finite number >= 0 (finite in bytes), got {self.weights_gb}"
            )
        for name in ("capacity_context", "tokens_per_boundary", "checkpoint_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.contexts or min(self.contexts) <= 0:
            raise ValueError(f"contexts must be positive token counts, got {list(self.contexts)}")


def all_full_config(cfg: ModelConfig) -> ModelConfig:
    """The hypothetical V4.1 where every compressed layer is a Full KV source (no CSA2 sharing)."""
    compressed = [layer for layer, r in enumerate(cfg.layer_ratios) if r > 0]
    return cfg.replace(
        kv_source_layer_ids=compressed, index_source_layer_ids=compressed, name=f"{cfg.name} (all-Full)"
    )


def plan_report(cfg: ModelConfig | DenseConfig, options: PlanOptions | None = None) -> dict[str, Any]:
    """Build the full report for ``cfg`` (see the module docstring); JSON-able."""
    opts = options or PlanOptions()
    spec = CacheSpec.from_config(cfg)
    report: dict[str, Any] = {
        "config": cfg.name,
        "model_type": cfg.model_type,
        "family": "dense" if isinstance(cfg, DenseConfig) else "v4.1" if cfg.is_v41 else "v4",
        "global_bytes_per_token": spec.global_bytes_per_token,
        "components": {
            "main_kv_bytes_per_token": spec.main_kv_bytes_per_token,
            "index_key_bytes_per_token": spec.index_key_bytes_per_token,
        },
    }
    if isinstance(cfg, ModelConfig):
        report["layer_plan"] = _layer_plan(cfg)
        if cfg.is_v41:
            report["components"]["encoder_bytes_per_token"] = spec.encoder_bytes_per_token
            report["components"]["decoder_bytes_per_token"] = spec.decoder_bytes_per_token
            full = CacheSpec.from_config(all_full_config(cfg)).global_bytes_per_token
            report["all_full_bytes_per_token"] = full
            report["all_full_ratio"] = full / spec.global_bytes_per_token
    report["per_layer"] = [
        {
            "layer_id": s.layer_id,
            "compress_ratio": s.compress_ratio,
            "main_format": s.main.name,
            "main_bytes_per_entry": s.main.bytes_per_entry,
            "index_key_format": s.index_key.name if s.index_key else None,
            "index_key_bytes_per_entry": s.index_key.bytes_per_entry if s.index_key else 0,
            "bytes_per_token": s.bytes_per_token,
        }
        for s in spec.compressed
    ] + [
        {
            "layer_id": d.layer_id,
            "compress_ratio": 1,
            "main_format": d.entry.name,
            "main_bytes_per_entry": d.bytes_per_token,
            "index_key_format": None,
            "index_key_bytes_per_entry": 0,
            "bytes_per_token": d.bytes_per_token,
        }
        for d in spec.dense
    ]
    report["window"] = {
        "layers": len(spec.windows),
        "window_tokens": spec.windows[0].window if spec.windows else 0,
        "entry_format": spec.windows[0].entry.name if spec.windows else None,
        "entry_bytes": spec.windows[0].entry.bytes_per_entry if spec.windows else 0,
        "bytes_per_request": spec.window_bytes_per_request,
    }
    report["compressor_tail_bytes_per_request"] = spec.tail_bytes_per_request
    report["contexts"] = [
        {"tokens": n, "global_bytes": spec.global_bytes(n), "request_bytes": spec.request_bytes(n)}
        for n in opts.contexts
    ]
    if spec.windows:
        v4_flash = isinstance(cfg, ModelConfig) and not cfg.is_v41
        block_size = CacheOptions().for_model(v4_flash=v4_flash).block_size
        # the engine refuses such a period (`kvdiet.engine.runner.pool_num_blocks`)
        if opts.checkpoint_every % block_size:
            raise ValueError(
                f"checkpoint_every {opts.checkpoint_every} must be a multiple of {cfg.name}'s block size "
                f"{block_size} (checkpoint:K stores the window at block boundaries)"
            )
        report["swa_policies"] = _policies(spec, opts, block_size)
    report["capacity"] = _capacity(cfg, spec, opts)
    report["context_warning"] = _context_warning(cfg, opts)
    return report


def _context_warning(cfg: ModelConfig | DenseConfig, opts: PlanOptions) -> str | None:
    """A warning naming the requested contexts (``--contexts``, ``--context``) past the config's
    ``max_position_embeddings``; None when all fit or the config has no such field. The byte figures for them
    are still computed (the formulas hold at any length); the model just cannot run that long."""
    limit = cfg.max_position_embeddings
    if limit is None:
        return None
    over = [f"{n:,}" for n in opts.contexts if n > limit]
    named = [f"{' / '.join(over)} (--contexts)"] if over else []
    if opts.capacity_context > limit:
        named.append(f"{opts.capacity_context:,} (--context)")
    if not named:
        return None
    return (
        f"context lengths past the model's max_position_embeddings {limit:,}: {' and '.join(named)}; the bytes "
        "are extrapolated, the model serves no context that long"
    )


def compare_reports(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two reports side by side with ``a / b`` ratios of the headline figures (and, with the persistent
    ratio, the ``tokens_per_boundary`` it was amortised over)."""

    def ratio(x: float, y: float) -> float | None:
        return x / y if y else None

    keys = ("global_bytes_per_token",)
    ratios = {k: ratio(a[k], b[k]) for k in keys}
    ratios["window_bytes_per_request"] = ratio(
        a["window"]["bytes_per_request"], b["window"]["bytes_per_request"]
    )
    ratios["compressor_tail_bytes_per_request"] = ratio(
        a["compressor_tail_bytes_per_request"], b["compressor_tail_bytes_per_request"]
    )
    ratios["sessions"] = ratio(a["capacity"]["sessions"], b["capacity"]["sessions"])
    for ca, cb in zip(a["contexts"], b["contexts"], strict=True):
        ratios[f"request_bytes@{ca['tokens']}"] = ratio(ca["request_bytes"], cb["request_bytes"])
    pa = {p["policy"]: p for p in a.get("swa_policies", [])}
    pb = {p["policy"]: p for p in b.get("swa_policies", [])}
    used: dict[str, int] = {}
    # The seeds' "persistent cache 1/8 of V4": A's default against B's boundary snapshots.
    if "bounded-replay" in pa and "boundary-snapshot" in pb:
        ratios["persistent_bounded_replay_vs_boundary_snapshot"] = ratio(
            pa["bounded-replay"]["amortised_bytes_per_token"],
            pb["boundary-snapshot"]["amortised_bytes_per_token"],
        )
        used = {"tokens_per_boundary": pb["boundary-snapshot"]["tokens_per_boundary"]}
    return {"a": a, "b": b, "ratios": ratios, **used}


def _layer_plan(cfg: ModelConfig) -> dict[str, Any]:
    plan = LayerPlan.from_config(cfg)
    roles = plan.roles()
    return {
        "roles": roles,
        "counts": {role: len(ids) for role, ids in roles.items()},
        "decoder_start": plan.decoder_start,
        "trailing_ratio_entries": list(cfg.compress_ratios[cfg.num_hidden_layers :]),
        "layers": [
            {
                "layer_id": i.layer_id,
                "role": i.role.value,
                "compress_ratio": i.compress_ratio,
                "kv_src": i.kv_src,
                "idx_src": i.idx_src,
                "candidate": i.candidate,
            }
            for i in plan.layers
        ],
    }


def _policies(spec: CacheSpec, opts: PlanOptions, block_size: int) -> list[dict[str, Any]]:
    """Each policy's persistent bytes over a session with a prompt/output end every ``tokens_per_boundary``
    tokens, snapshots taken where the engine takes them: at the last boundary of a ``block_size``-token block
    at or before each end (`kvdiet.cache.policies.base.BoundaryCapture.capture_candidates`; the engine's
    block size, `CacheOptions.for_model`: V4-Flash 128), one per block boundary."""
    n, every = opts.tokens_per_boundary, opts.checkpoint_every
    # 64 ends at least, and 64 blocks at least: a shorter session (64 ends 1 token apart) reached no block
    # boundary, so no snapshot, and closed few compressed groups (bytes per token under the global cache's)
    tokens = n * max(64, -(-64 * block_size // n))
    snapshots = sorted({e // block_size * block_size for e in range(n, tokens + 1, n)} - {0})
    rows = []
    for text in (
        "bounded-replay",
        "boundary-snapshot",
        "full-store",
        f"checkpoint:{every}",
        "exact-recompute",
    ):
        policy = parse_policy(text)
        # Amortise over a long session of `tokens_per_boundary`-token segments, a prompt/output end after each:
        # snapshots at the block boundaries at or before n, 2n, ..., each at its bytes.
        stored = policy.persistent_bytes(spec, tokens, boundaries=snapshots)
        rows.append(
            {
                "policy": str(policy),
                "exact": policy.exact,
                "global_bytes_per_token": spec.global_bytes_per_token,
                "amortised_bytes_per_token": stored / tokens,
                "ratio_to_global": stored / tokens / spec.global_bytes_per_token,
                "recompute_tokens_on_hit": policy.recompute_tokens(spec, 10**9),
                "tokens_per_boundary": n,
                "block_size": block_size,
            }
        )
    return rows


def _capacity(cfg: ModelConfig | DenseConfig, spec: CacheSpec, opts: PlanOptions) -> dict[str, Any]:
    if opts.weights_gb is None:
        weights_bytes, source = round(estimate_weights(cfg).device_bytes), "estimate"
    else:
        weights_bytes, source = round(opts.weights_gb * 1e9), "flag"
    total = round(opts.gpu_mem_gb * 1e9) * opts.num_gpus  # whole bytes: the session count below is exact
    budget = max(0, total - weights_bytes)
    per_session = spec.request_bytes(opts.capacity_context)
    warning = None
    if weights_bytes >= total and weights_bytes > 0:  # no weights never fail to fit (a 0-byte device)
        warning = (
            f"the weights ({format_gb(weights_bytes / 1e9, 1)} GB) do not fit in {opts.num_gpus:,} × "
            f"{opts.gpu_mem_gb:g} GB = {format_gb(total / 1e9, 1)} GB: nothing is left for the KV cache"
        )
    elif budget < per_session:
        warning = (
            f"{budget / 1e9:,.2f} GB left for the KV cache after the weights holds no session of "
            f"{opts.capacity_context:,} tokens ({per_session / 1e9:,.2f} GB each)"
        )
    return {
        "gpu": opts.gpu,
        "gpu_mem_gb": opts.gpu_mem_gb,
        "num_gpus": opts.num_gpus,
        "weights_gb": weights_bytes / 1e9,
        "weights_source": source,
        "kv_budget_gb": budget / 10**9,  # int / int: correctly rounded
        "context": opts.capacity_context,
        "bytes_per_session": per_session,
        "sessions": budget // per_session,
        "warning": warning,
    }
