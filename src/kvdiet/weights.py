"""Device weight bytes estimated from a config, for capacity planning when ``--weights-gb`` is not given.

An estimate, not a checkpoint census: it counts the large matrices and their storage precision.
- V4 family (v41-spec §1.1, §8.2): routed experts in MXFP4 (E2M1 + UE8M0 per 32 → 0.53125 B/param);
  other linear weights in FP8 with one scale per 32×32 (V4.1) or 128×128 (V4) block (≈1 B/param);
  embedding and LM head in bf16. Engram tables (≈98 GB each at full size) are counted apart and are not
  on the device by default (``engram_on_device=False``): DeepSeek places them in host memory.
- Dense baselines: every matrix in bf16 (GQA attention, SwiGLU MLP of ``intermediate_size``, or
  ``4 × hidden`` when absent).
Norms, mHC mixing and other vectors are ignored (< 0.1 %).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdiet.config import DenseConfig, ModelConfig
from kvdiet.layer_plan import LayerPlan

__all__ = ["WeightEstimate", "estimate_weights"]

MXFP4_BYTES_PER_PARAM = 0.5 + 1 / 32
FP8_BYTES_PER_PARAM = 1.0
BF16_BYTES_PER_PARAM = 2.0


@dataclass(frozen=True, slots=True)
class WeightEstimate:
    """Estimated parameter counts and bytes.

    Attributes:
        params: parameters placed on the device.
        device_bytes: their bytes at storage precision.
        engram_params: Engram table parameters (host-resident unless ``engram_on_device``).
        engram_bytes: Engram table bytes (FP8 rows + UE8M0 per 32).
    """

    params: int
    device_bytes: float
    engram_params: int
    engram_bytes: float


def estimate_weights(cfg: ModelConfig | DenseConfig, *, engram_on_device: bool = False) -> WeightEstimate:
    """Estimate the weights of ``cfg`` (see the module docstring for the precision assumptions)."""
    if isinstance(cfg, DenseConfig):
        return _dense(cfg)
    h, n = cfg.hidden_size, cfg.num_hidden_layers
    attn = (
        h * cfg.q_lora_rank
        + cfg.q_lora_rank * cfg.num_attention_heads * cfg.head_dim
        + h * cfg.head_dim  # window wkv
        + cfg.num_attention_heads * cfg.head_dim * cfg.o_lora_rank  # grouped wo_a
        + cfg.o_groups * cfg.o_lora_rank * h
    )
    plan = LayerPlan.from_config(cfg)
    extra = 0
    for info in plan.layers:
        if info.owns_compressed_kv:
            gates = 1 if (cfg.is_v41 and info.compress_ratio == 1) else 2
            extra += gates * h * cfg.head_dim
        if info.owns_indexer:
            extra += cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + h * cfg.index_n_heads
        if info.owns_index_keys:
            extra += cfg.head_dim * cfg.index_head_dim
    experts = n * cfg.n_routed_experts * 3 * h * cfg.moe_intermediate_size
    shared = n * (cfg.n_shared_experts * 3 * h * cfg.moe_intermediate_size + h * cfg.n_routed_experts)
    embed_head = 2 * cfg.vocab_size * h
    fp8_params = n * attn + extra + shared
    engram = sum(cfg.engram_num_embeddings or ()) * (cfg.engram_head_dim or 0)
    engram_bytes = engram * (1 + 1 / 32)
    device = (
        experts * MXFP4_BYTES_PER_PARAM + fp8_params * FP8_BYTES_PER_PARAM + embed_head * BF16_BYTES_PER_PARAM
    )
    params = experts + fp8_params + embed_head
    if engram_on_device:
        device += engram_bytes
        params += engram
    return WeightEstimate(params, device, engram, engram_bytes)


def _dense(cfg: DenseConfig) -> WeightEstimate:
    h = cfg.hidden_size
    kv = (
        cfg.kv_lora_rank + (cfg.qk_rope_head_dim or 0)
        if cfg.kv_lora_rank
        else 2 * cfg.kv_heads * cfg.kv_head_dim
    )
    attn = 2 * h * h + h * kv
    mlp = 3 * h * (cfg.intermediate_size or 4 * h)
    params = cfg.num_hidden_layers * (attn + mlp) + 2 * (cfg.vocab_size or 0) * h
    return WeightEstimate(params, params * BF16_BYTES_PER_PARAM, 0, 0.0)
