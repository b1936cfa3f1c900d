"""A tiny V4-Flash config shared by the V4 model and engine tests (not a test module)."""

from __future__ import annotations

from kvdiet.config import ModelConfig, load_config


def tiny_v4_config() -> ModelConfig:
    """4 layers: SWA, CSA (ratio 4, overlapping, indexer top-4), HCA (ratio 128), CSA; 2 hash-routed MoE layers."""
    return load_config("deepseek-v4-flash").replace(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        head_dim=64,
        qk_rope_head_dim=16,
        q_lora_rank=32,
        o_lora_rank=16,
        o_groups=2,
        index_n_heads=8,
        index_head_dim=32,
        index_topk=4,
        sliding_window=8,
        compress_ratios=[0, 4, 128, 4, 0],
        num_hash_layers=2,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        dspark_target_layer_ids=None,
        dspark_block_size=None,
    )
