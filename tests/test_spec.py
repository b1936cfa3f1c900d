"""Byte accounting (issue: foundation, point 5): the figures DESIGN.md §1 says kvdiet must reproduce."""

from __future__ import annotations

import pytest

from kvdiet.cache.spec import CacheSpec, CompressedKVSpec
from kvdiet.config import ConfigError, DenseConfig, load_config
from kvdiet.formats.layout import index_key_format, main_kv_format, v4_record_format, window_format
from kvdiet.planner.report import all_full_config


def test_v41_global_890() -> None:
    spec = CacheSpec.from_config(load_config("deepseek-v4.1-flash"))
    assert spec.global_bytes_per_token == 890.0
    assert spec.encoder_bytes_per_token == 534.0  # 3 × (288 + 68) / 2
    assert spec.decoder_bytes_per_token == 356.0  # layer 20: 288 + 68
    assert spec.main_kv_bytes_per_token == 720.0 and spec.index_key_bytes_per_token == 170.0
    assert spec.window_bytes_per_request == 2_703_360 == 40 * 128 * 528
    assert spec.tail_bytes_per_request == 3 * 8192  # fp32 [2, 512] kv + score per ratio-2 source
    assert spec.global_bytes(1_000_000) == 890_000_000  # 1M → 0.89 GB
    assert spec.global_bytes(7) == 3 * 3 * 356 + 7 * 356  # an open ratio-2 pair has no entry yet


def test_v41_all_full_hypothetical() -> None:
    cfg = load_config("deepseek-v4.1-flash")
    full = CacheSpec.from_config(all_full_config(cfg)).global_bytes_per_token
    assert full == 10_324.0 == 18 * 356 / 2 + 20 * 356
    assert round(full / 890.0, 1) == 11.6


def test_mini_equals_real_bytes() -> None:
    real = CacheSpec.from_config(load_config("deepseek-v4.1-flash"))
    mini = CacheSpec.from_config(load_config("v4.1-mini"))
    assert mini.global_bytes_per_token == real.global_bytes_per_token == 890.0
    assert mini.window_bytes_per_request == real.window_bytes_per_request


def test_v4_global_formula() -> None:
    spec = CacheSpec.from_config(load_config("deepseek-v4-flash"))
    csa, hca = 21 * (584 + 68) / 4, 20 * 584 / 128
    assert spec.global_bytes_per_token == csa + hca == 3514.25
    assert spec.window_bytes_per_request == 43 * 128 * 584
    assert round(spec.global_bytes_per_token / 890.0, 2) == 3.95


def test_dense_baselines(write_config) -> None:
    v1 = CacheSpec.from_config(load_config("deepseek-llm-67b"))
    assert v1.global_bytes_per_token == 389_120 == 2 * 95 * 8 * 128 * 2
    assert round(v1.global_bytes_per_token / 890) == 437
    small = DenseConfig.from_hf_json(
        write_config(
            {
                "model_type": "llama",
                "num_hidden_layers": 24,
                "hidden_size": 512,
                "num_attention_heads": 8,
                "num_key_value_heads": 8,
                "head_dim": 64,
            }
        )
    )
    assert CacheSpec.from_config(small).global_bytes_per_token == 49_152
    mla = DenseConfig.from_hf_json(
        write_config(
            {
                "model_type": "deepseek_v3",
                "num_hidden_layers": 61,
                "hidden_size": 7168,
                "num_attention_heads": 128,
                "kv_lora_rank": 512,
                "qk_rope_head_dim": 64,
            }
        )
    )
    assert CacheSpec.from_config(mla).global_bytes_per_token == 61 * 576 * 2
    assert CacheSpec.from_config(small).window_bytes_per_request == 0


def test_entry_formats_bytes() -> None:
    assert main_kv_format(512).bytes_per_entry == 288
    assert index_key_format(128).bytes_per_entry == 68
    assert window_format(512).bytes_per_entry == 528
    rec = v4_record_format(512, 64)
    assert (rec.value_bytes, rec.tail_bytes, rec.num_scales, rec.pad_bytes, rec.bytes_per_entry) == (
        448,
        128,
        7,
        1,
        584,
    )
    with pytest.raises(ValueError, match="not a multiple of the scale block"):
        main_kv_format(24)


def test_pages() -> None:
    spec = CompressedKVSpec(2, 2, main_kv_format(), index_key_format())
    assert spec.page_bytes(64) == 32 * 356
    assert spec.entries(17) == 8
    with pytest.raises(ValueError, match="block_size 63 is not a positive multiple"):
        spec.page_bytes(63)


def test_spec_rejects_nothing_silently() -> None:
    with pytest.raises(ConfigError):
        load_config("v4.1-micro").replace(index_head_dim=0)
