"""The checks a `ModelConfig` must pass before anything is built from it, and `ConfigError`, which they and the
config readers (`kvdiet.config`) raise.

`validate_model_config` checks the fields the layer plan, the caches and the formats depend on
(v41-spec §1.2): positive sizes, an even RoPE dim below the head dim, an index head dim of whole MXFP4
blocks holding the RoPE dims, head and expert counts that divide, one compress ratio per layer, and for
V4.1 the KV and index sources (sorted, compressed, each KV source its own index source, every compressed
layer reading a KV source of its own ratio) and the candidate source.
Every error names the field and the bad value. Not known here: JSON, presets, roles (`kvdiet.layer_plan`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvdiet.config import ModelConfig

__all__ = ["ConfigError", "no_config", "validate_model_config"]


class ConfigError(ValueError):
    """A config file or field is invalid; the message names the field and the bad value."""


def no_config(text: str, presets: list[str]) -> ConfigError:
    """The error for ``text``, a model named by `kvdiet.config.load_config` that is no preset and no config file:
    a directory is not a config file, a path not there is no such file, a bare name is neither."""
    path, names = Path(text), ", ".join(presets)
    if text and path.exists():  # ("" reads as the current directory)
        return ConfigError(f"{text!r} is not a config file (a preset is one of {names})")
    if path.suffix or len(path.parts) > 1:  # a path, not a preset's name
        return ConfigError(f"{text!r}: no such file (nor a preset: {names})")
    return ConfigError(f"{text!r} is neither a preset ({names}) nor a config file")


def validate_model_config(cfg: ModelConfig) -> None:
    """Check the fields that the layer plan, caches and formats depend on (v41-spec §1.2).

    Raises:
        ConfigError: the first bad field, named with its value.
    """
    for field in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "head_dim",
        "index_n_heads",
        "index_head_dim",
        "index_topk",
        "max_position_embeddings",
        "hc_mult",
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "q_lora_rank",
        "o_lora_rank",
        "o_groups",
        "num_key_value_heads",
        "n_shared_experts",
        "hc_sinkhorn_iters",
        "rms_norm_eps",
        "hc_eps",
        "rope_theta",
        "compress_rope_theta",
    ):
        if getattr(cfg, field) <= 0:
            raise ConfigError(f"{field} must be > 0, got {getattr(cfg, field)}")
    for field in ("num_nextn_predict_layers", "dspark_block_size", "num_hash_layers", "engram_pad_token_id"):
        value = getattr(cfg, field)
        if value is not None and value < 0:
            raise ConfigError(f"{field} must be >= 0, got {value}")
    if cfg.num_key_value_heads != 1:  # one KV head shared by every query head (v41-spec §1.2; both releases)
        raise ConfigError(
            f"num_key_value_heads must be 1 (the V4 family's attention reads one shared KV head), got "
            f"{cfg.num_key_value_heads}"
        )
    for field in ("bos_token_id", "eos_token_id", "engram_pad_token_id"):  # token ids: rows of the vocabulary
        value = getattr(cfg, field)
        if value is not None and value >= cfg.vocab_size:
            raise ConfigError(f"{field} must be < vocab_size {cfg.vocab_size}, got {value}")
        if value is not None and value < 0:  # engram_pad_token_id: refused as negative above
            raise ConfigError(f"{field} must be >= 0, got {value}")
    if cfg.swiglu_limit < 0:  # 0: no clamp
        raise ConfigError(f"swiglu_limit must be >= 0 (0: no clamp), got {cfg.swiglu_limit}")
    if cfg.rope_scaling is not None and not cfg.rope_scaling.factor > 0:
        raise ConfigError(f"rope_scaling.factor must be > 0, got {cfg.rope_scaling.factor}")
    _validate_engram(cfg)
    if cfg.sliding_window <= 0:
        raise ConfigError(f"sliding_window must be > 0, got {cfg.sliding_window}")
    if not 0 < cfg.qk_rope_head_dim < cfg.head_dim or cfg.qk_rope_head_dim % 2:
        raise ConfigError(
            f"qk_rope_head_dim must be even and in (0, head_dim={cfg.head_dim}), got {cfg.qk_rope_head_dim}"
        )
    if cfg.index_head_dim % 32 or cfg.index_head_dim < cfg.qk_rope_head_dim:
        raise ConfigError(
            f"index_head_dim must be a multiple of 32 (the MXFP4 index keys' scale block, v41-spec §5) and at "
            f"least qk_rope_head_dim={cfg.qk_rope_head_dim} (RoPE turns its last dims), got {cfg.index_head_dim}"
        )
    if cfg.is_v41 and cfg.head_dim % 16:
        raise ConfigError(
            f"head_dim must be a multiple of 16 (the FP4 main KV's scale block, v41-spec §5), got {cfg.head_dim}"
        )
    if cfg.num_attention_heads % cfg.o_groups:
        raise ConfigError(
            f"num_attention_heads {cfg.num_attention_heads} is not a multiple of o_groups {cfg.o_groups}"
        )
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise ConfigError(
            f"num_experts_per_tok {cfg.num_experts_per_tok} exceeds n_routed_experts {cfg.n_routed_experts}"
        )
    n = cfg.num_hidden_layers
    if len(cfg.compress_ratios) < n:
        raise ConfigError(
            f"compress_ratios has {len(cfg.compress_ratios)} entries, fewer than num_hidden_layers={n}: "
            f"{list(cfg.compress_ratios)}"
        )
    for i, r in enumerate(cfg.compress_ratios):
        if r < 0:
            raise ConfigError(f"compress_ratios[{i}] must be >= 0, got {r}")
    if cfg.is_v41:
        _validate_v41_sources(cfg)
    for field in ("engram_layer_ids", "dspark_target_layer_ids"):
        for layer in getattr(cfg, field) or ():
            if not 0 <= layer < n:
                raise ConfigError(f"{field} entry {layer} is outside [0, num_hidden_layers={n})")


def _validate_engram(cfg: ModelConfig) -> None:
    """With Engram layers (``engram_layer_ids``), every size the Engram modules and the cache spec read: one table
    size per layer, an n-gram of at least 2 tokens, positive heads, head dim and vocabularies."""
    if not cfg.engram_layer_ids:
        return
    sizes = cfg.engram_num_embeddings
    if sizes is None or len(sizes) != len(cfg.engram_layer_ids):
        raise ConfigError(
            f"engram_num_embeddings must give one table size per engram_layer_ids entry "
            f"({len(cfg.engram_layer_ids)}), got {None if sizes is None else list(sizes)}"
        )
    for i, size in enumerate(sizes):
        if size <= 0:
            raise ConfigError(f"engram_num_embeddings[{i}] must be > 0, got {size}")
    if cfg.engram_max_ngram_size is None or cfg.engram_max_ngram_size < 2:
        raise ConfigError(
            f"engram_max_ngram_size must be at least 2 with engram_layer_ids set, got {cfg.engram_max_ngram_size}"
        )
    for field in ("engram_n_heads", "engram_head_dim", "engram_vocab_size"):
        value = getattr(cfg, field)
        if value is None or value <= 0:
            raise ConfigError(f"{field} must be > 0 with engram_layer_ids set, got {value}")


def _validate_v41_sources(cfg: ModelConfig) -> None:
    n, ratios = cfg.num_hidden_layers, cfg.compress_ratios
    for field in ("kv_source_layer_ids", "index_source_layer_ids"):
        ids = getattr(cfg, field)
        if not ids:
            raise ConfigError(f"{field} is required for model_type {cfg.model_type!r}")
        if list(ids) != sorted(set(ids)):
            raise ConfigError(f"{field} must be strictly increasing, got {list(ids)}")
        for layer in ids:
            if not 0 <= layer < n:
                raise ConfigError(f"{field} entry {layer} is outside [0, num_hidden_layers={n})")
            if ratios[layer] == 0:
                raise ConfigError(
                    f"{field} entry {layer} has compress_ratios[{layer}] = 0 (an SWA-only layer)"
                )
    kv, idx = cfg.kv_source_layer_ids or (), cfg.index_source_layer_ids or ()
    missing = sorted(set(kv) - set(idx))
    if missing:
        raise ConfigError(
            f"kv_source_layer_ids {missing} are not in index_source_layer_ids: a KV source "
            f"must own the indexer that writes its index keys"
        )
    for s in idx:
        below = [k for k in kv if k <= s]
        if not below:
            raise ConfigError(f"index_source_layer_ids entry {s} is not at or above any KV source {list(kv)}")
        if ratios[below[-1]] != ratios[s]:
            raise ConfigError(
                f"index source {s} (ratio {ratios[s]}) reads KV source {below[-1]} of ratio "
                f"{ratios[below[-1]]}"
            )
    for layer in range(n):
        r = ratios[layer]
        if r == 0:
            continue
        below = [k for k in kv if k <= layer]
        if not below:
            raise ConfigError(
                f"layer {layer} has compress_ratios[{layer}] = {r} but no KV source at or "
                f"below it in {list(kv)}"
            )
        if ratios[below[-1]] != r:
            raise ConfigError(
                f"layer {layer} (ratio {r}) would read KV source {below[-1]} of ratio {ratios[below[-1]]}"
            )
    c = cfg.candidate_source_layer_id
    if c is not None:
        if c not in kv or c not in idx:
            raise ConfigError(f"candidate_source_layer_id {c} must be both a KV and an index source")
        for field in ("candidate_topk_blocks", "candidate_block_size"):
            value = getattr(cfg, field)
            if value is None or value <= 0:
                raise ConfigError(f"{field} must be > 0 when candidate_source_layer_id is set, got {value}")
