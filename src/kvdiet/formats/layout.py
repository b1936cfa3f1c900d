"""Byte layouts of the packed cache entries: how many bytes one entry takes, and where each part lies.

This module is torch-free on purpose: the cache control plane and the planner size pools from these
declarations without importing torch. The quantisers that fill the bytes live beside it (`fp4`,
`mxfp4`, `fp8`, `v4_record`) and each one asserts that it writes exactly `bytes_per_entry` bytes.

An entry of ``dim`` values is laid out as: ``value bytes | bf16 tail | scale bytes | pad``.

| format | used for | values | scales | bytes (dim) |
|---|---|---|---|---|
| ``fp4_e2m1_e4m3x16`` | V4.1 main KV | E2M1, 2/byte, low nibble = even index | E4M3 per 16 | dim/2 + dim/16 (288) |
| ``mxfp4`` | V4.1/V4 index keys | E2M1, as above | UE8M0 per 32 | dim/2 + dim/32 (128 → 68) |
| ``mxfp8`` | V4.1 window (SWA) entry | E4M3, 1 per byte | UE8M0 per 32 | dim + dim/32 (512 → 528) |
| ``v4_fp8_record`` | V4 window and main KV | E4M3 on dim−rope, rope bf16 | UE8M0 per 64, pad to 8 | 448+128+7+1 = 584 |
| ``bf16`` | dense baselines (K or V) | bf16 | none | 2·dim |

Sources: v41-spec §5.1–5.2 (DeepSeek's reference kernel semantics, VLLM ``nvfp4_ds_mla`` /
``fp8_ds_mla`` records, TRT-LLM's 356 B = 288 + 68 global row).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "EntryFormat",
    "bf16_format",
    "index_key_format",
    "main_kv_format",
    "v4_record_format",
    "window_format",
]


@dataclass(frozen=True, slots=True)
class EntryFormat:
    """One packed cache entry: ``dim`` values quantised in blocks of ``scale_block`` with one scale each.

    Attributes:
        name: format name, part of the model fingerprint (a cache written in one format is never read
            as another).
        dim: values per entry.
        value_bits: bits per stored value (4 for E2M1, 8 for E4M3, 16 for bf16).
        scale_block: values per scale (0: no scales).
        scale_dtype: ``"e4m3"``, ``"ue8m0"`` or ``""`` (no scales).
        bf16_tail: trailing values kept unquantised in bf16 (the V4 record's RoPE dims); they take no
            scale.
        align: the entry size is rounded up to a multiple of this many bytes (zero-filled pad).
    """

    name: str
    dim: int
    value_bits: int
    scale_block: int
    scale_dtype: str
    bf16_tail: int = 0
    align: int = 1

    def __post_init__(self) -> None:
        quantised = self.dim - self.bf16_tail
        if self.dim <= 0 or quantised <= 0:
            raise ValueError(
                f"{self.name}: dim must exceed bf16_tail, got dim={self.dim}, tail={self.bf16_tail}"
            )
        if (quantised * self.value_bits) % 8:
            raise ValueError(f"{self.name}: {quantised} values of {self.value_bits} bits are not whole bytes")
        if self.scale_block and quantised % self.scale_block:
            raise ValueError(
                f"{self.name}: dim {quantised} (quantised part) is not a multiple of the scale block "
                f"{self.scale_block}"
            )

    @property
    def quantised_dim(self) -> int:
        """Values that go through the quantiser (``dim − bf16_tail``)."""
        return self.dim - self.bf16_tail

    @property
    def value_bytes(self) -> int:
        """Bytes of packed values at the start of the entry."""
        return self.quantised_dim * self.value_bits // 8

    @property
    def tail_bytes(self) -> int:
        """Bytes of the bf16 tail that follows the values."""
        return 2 * self.bf16_tail

    @property
    def num_scales(self) -> int:
        """Scales per entry, one byte each."""
        return self.quantised_dim // self.scale_block if self.scale_block else 0

    @property
    def scale_offset(self) -> int:
        """Byte offset of the first scale."""
        return self.value_bytes + self.tail_bytes

    @property
    def pad_bytes(self) -> int:
        """Zero bytes after the scales that round the entry up to ``align``."""
        used = self.scale_offset + self.num_scales
        return -used % self.align

    @property
    def bytes_per_entry(self) -> int:
        """Total bytes one packed entry occupies."""
        return self.scale_offset + self.num_scales + self.pad_bytes


def main_kv_format(dim: int = 512) -> EntryFormat:
    """V4.1 main compressed KV: E2M1 + one E4M3 scale per 16 values; 288 B at dim 512 (v41-spec §5.2)."""
    return EntryFormat("fp4_e2m1_e4m3x16", dim, value_bits=4, scale_block=16, scale_dtype="e4m3")


def index_key_format(dim: int = 128) -> EntryFormat:
    """Index key: MXFP4, E2M1 + one UE8M0 scale per 32 values; 68 B at dim 128 (v41-spec §4, §5.2)."""
    return EntryFormat("mxfp4", dim, value_bits=4, scale_block=32, scale_dtype="ue8m0")


def window_format(dim: int = 512) -> EntryFormat:
    """V4.1 window (SWA) entry: MXFP8, E4M3 + one UE8M0 scale per 32 values; 528 B at dim 512."""
    return EntryFormat("mxfp8", dim, value_bits=8, scale_block=32, scale_dtype="ue8m0")


def v4_record_format(dim: int = 512, rope_dim: int = 64) -> EntryFormat:
    """V4 record: E4M3 on the first dim−rope values (UE8M0 per 64), RoPE dims in bf16, padded to 8 bytes.

    448 + 128 + 7 + 1 = 584 B at dim 512, rope 64 (v41-spec §5.2, V4REF).
    """
    return EntryFormat(
        "v4_fp8_record", dim, value_bits=8, scale_block=64, scale_dtype="ue8m0", bf16_tail=rope_dim, align=8
    )


def bf16_format(dim: int) -> EntryFormat:
    """Plain bf16 vector (dense-attention baselines): 2 bytes per value, no scales."""
    return EntryFormat("bf16", dim, value_bits=16, scale_block=0, scale_dtype="")
