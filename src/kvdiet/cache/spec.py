"""Byte accounting: one frozen spec per layer-cache kind, composed from the declared entry formats.

This is the one place where cache bytes are defined; the planner, the device pool and the model's
``cache_bytes()`` report all read them from here. Torch-free.

Kinds (v41-spec §5, §3):
- `CompressedKVSpec` — a KV-source layer's global cache: one main-KV entry (plus one index key where the
  layer owns index keys) per ``compress_ratio`` tokens. Global: it grows with the context and is what
  the prefix cache and the persistent tier store.
- `WindowSpec` — a layer's sliding-window ring: ``sliding_window`` entries per request, fixed.
- `CompressorTailSpec` — fp32 rows a compressor holds until its group completes, per request, fixed.
- `DenseKVSpec` — a dense-attention baseline layer (bf16 K and V per token, or one MLA latent).

`CacheSpec.from_config` builds all of them for a config; V4.1's real config gives 890.0 B/token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvdiet.config import DenseConfig, ModelConfig
from kvdiet.formats.layout import (
    EntryFormat,
    bf16_format,
    index_key_format,
    main_kv_format,
    v4_record_format,
    window_format,
)
from kvdiet.layer_plan import LayerPlan, Role

__all__ = [
    "FP32_BYTES",
    "SNAPSHOT_FRAME_BYTES",
    "CacheSpec",
    "CompressedKVSpec",
    "CompressorTailSpec",
    "DenseKVSpec",
    "WindowSpec",
]

FP32_BYTES = 4
SNAPSHOT_FRAME_BYTES = 16
"""A window snapshot's magic (8 B), header length (u32) and CRC-32 (u32) (`kvdiet.model.snapshot`)."""


@dataclass(frozen=True, slots=True)
class CompressedKVSpec:
    """A KV-source layer's compressed cache: one entry per ``compress_ratio`` tokens.

    Attributes:
        layer_id: the owning layer.
        compress_ratio: tokens per entry.
        main: main-KV entry format (288 B for V4.1, 584 B for V4).
        index_key: index-key entry format (68 B), or None (V4 HCA layers own no index keys).
    """

    layer_id: int
    compress_ratio: int
    main: EntryFormat
    index_key: EntryFormat | None

    @property
    def bytes_per_entry(self) -> int:
        """Main-KV plus index-key bytes of one compressed entry."""
        return self.main.bytes_per_entry + (self.index_key.bytes_per_entry if self.index_key else 0)

    @property
    def bytes_per_token(self) -> float:
        """Amortised bytes per token: ``bytes_per_entry / compress_ratio``."""
        return self.bytes_per_entry / self.compress_ratio

    def entries(self, num_tokens: int) -> int:
        """Complete entries after ``num_tokens`` tokens (an open group has no entry yet)."""
        return num_tokens // self.compress_ratio

    def bytes_for(self, num_tokens: int) -> int:
        """Bytes held after ``num_tokens`` tokens."""
        return self.entries(num_tokens) * self.bytes_per_entry

    def page_bytes(self, block_size: int) -> int:
        """Bytes of one page covering ``block_size`` tokens.

        Raises:
            ValueError: ``block_size`` is not a positive multiple of ``compress_ratio``.
        """
        if block_size <= 0 or block_size % self.compress_ratio:
            raise ValueError(
                f"block_size {block_size} is not a positive multiple of the compress ratio "
                f"{self.compress_ratio} of layer {self.layer_id}"
            )
        return block_size // self.compress_ratio * self.bytes_per_entry


@dataclass(frozen=True, slots=True)
class WindowSpec:
    """A layer's sliding-window ring: ``window`` entries of ``entry`` per request (fixed size)."""

    layer_id: int
    window: int
    entry: EntryFormat

    @property
    def bytes_per_request(self) -> int:
        """``window × entry bytes`` (128 × 528 = 67,584 B per V4.1 layer)."""
        return self.window * self.entry.bytes_per_entry


@dataclass(frozen=True, slots=True)
class CompressorTailSpec:
    """fp32 rows a compressor keeps for an open group, per request: ``rows × width`` for kv and for score.

    V4.1 ratio 2: rows 2, width ``head_dim`` → 8 KiB per layer at head_dim 512 (v41-spec §3.1, §5.2).
    Ratio-1 compressors keep nothing. V4 (v41-spec §3.2): CSA keeps 2·ratio rows of 2·head_dim (overlap)
    and its index compressor's 2·index_head_dim beside them (one tail, as the model holds it); HCA keeps
    ratio rows of head_dim.

    Attributes:
        layer_id: the owning layer.
        rows: rows allocated (``ratio``, or ``2 × ratio`` for an overlapping compressor).
        width: fp32 values per row.
        overlap: an overlapping (V4 CSA) compressor: rows ``[0, ratio)`` keep the last complete window,
            the open rows follow at ``[ratio, ratio + open)``.
    """

    layer_id: int
    rows: int
    width: int
    overlap: bool = False

    @property
    def bytes_per_request(self) -> int:
        """``2 (kv and score) × rows × width × 4`` bytes: what the tail allocates."""
        return 2 * self.rows * self.width * FP32_BYTES

    def rows_held(self, num_tokens: int) -> int:
        """Rows that hold anything after ``num_tokens`` tokens (what a window snapshot writes).

        Plain: the open rows, ``num_tokens mod ratio``. Overlapping: none before the first token, then the
        ``ratio`` rows of the last complete window (empty before one completes, but written: the open rows
        sit after them) and the open rows (`kvdiet.model.v4.compressor`).
        """
        if not self.overlap:
            return num_tokens % self.rows
        ratio = self.rows // 2
        return 0 if num_tokens == 0 else ratio + num_tokens % ratio


@dataclass(frozen=True, slots=True)
class DenseKVSpec:
    """A dense-attention layer of a baseline model: ``values_per_token`` bf16 values per token.

    MHA/GQA: ``2 × kv_heads × head_dim`` (K and V); MLA: ``kv_lora_rank + qk_rope_head_dim``.
    """

    layer_id: int
    entry: EntryFormat

    @property
    def bytes_per_token(self) -> int:
        """Bytes this layer adds per token."""
        return self.entry.bytes_per_entry


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """All cache kinds of one model.

    Attributes:
        name: config name.
        compressed: global caches, one per KV-source layer.
        windows: window rings, one per layer (none for dense baselines).
        tails: compressor tails (per-request fixed state).
        dense: dense per-token layers (baselines only).
        encoder_layers: V4.1 layers below the decoder start (for the encoder/decoder split), else all.
    """

    name: str
    compressed: tuple[CompressedKVSpec, ...]
    windows: tuple[WindowSpec, ...]
    tails: tuple[CompressorTailSpec, ...]
    dense: tuple[DenseKVSpec, ...] = ()
    encoder_layers: frozenset[int] = frozenset()
    engram_history: int = 0

    @classmethod
    def from_config(cls, cfg: ModelConfig | DenseConfig) -> CacheSpec:
        """Compose the specs of ``cfg`` from its layer plan and the entry formats (v41-spec §5)."""
        if isinstance(cfg, DenseConfig):
            return _dense_spec(cfg)
        plan = LayerPlan.from_config(cfg)
        compressed, tails = [], []
        for info in plan.layers:
            if not info.owns_compressed_kv:
                continue
            r = info.compress_ratio
            if cfg.is_v41:
                main = main_kv_format(cfg.head_dim)
                index = index_key_format(cfg.index_head_dim)
                if r > 1:
                    tails.append(CompressorTailSpec(info.layer_id, rows=r, width=cfg.head_dim))
            else:
                main = v4_record_format(cfg.head_dim, cfg.qk_rope_head_dim)
                index = index_key_format(cfg.index_head_dim) if info.owns_index_keys else None
                if info.role is Role.CSA:
                    width = 2 * (cfg.head_dim + cfg.index_head_dim)  # main and index compressor, one tail
                    tails.append(CompressorTailSpec(info.layer_id, 2 * r, width, overlap=True))
                else:
                    tails.append(CompressorTailSpec(info.layer_id, rows=r, width=cfg.head_dim))
            compressed.append(CompressedKVSpec(info.layer_id, r, main, index))
        entry = (
            window_format(cfg.head_dim)
            if cfg.is_v41
            else v4_record_format(cfg.head_dim, cfg.qk_rope_head_dim)
        )
        windows = tuple(
            WindowSpec(layer, cfg.sliding_window, entry) for layer in range(cfg.num_hidden_layers)
        )
        history = cfg.engram_max_ngram_size - 1 if cfg.engram_layer_ids else 0
        return cls(
            cfg.name,
            tuple(compressed),
            windows,
            tuple(tails),
            encoder_layers=frozenset(plan.encoder_layers),
            engram_history=history,
        )

    # --- per token (global, grows with context) ---

    @property
    def global_bytes_per_token(self) -> float:
        """Global KV bytes per token: Σ compressed (main + index) / ratio, plus dense layers."""
        return sum(s.bytes_per_token for s in self.compressed) + sum(d.bytes_per_token for d in self.dense)

    @property
    def main_kv_bytes_per_token(self) -> float:
        """Main-KV part of `global_bytes_per_token` (dense layers count here)."""
        return sum(s.main.bytes_per_entry / s.compress_ratio for s in self.compressed) + sum(
            d.bytes_per_token for d in self.dense
        )

    @property
    def index_key_bytes_per_token(self) -> float:
        """Index-key part of `global_bytes_per_token`."""
        return sum(s.index_key.bytes_per_entry / s.compress_ratio for s in self.compressed if s.index_key)

    @property
    def encoder_bytes_per_token(self) -> float:
        """Global bytes per token written by encoder layers (V4.1: 534 B)."""
        return sum(s.bytes_per_token for s in self.compressed if s.layer_id in self.encoder_layers)

    @property
    def decoder_bytes_per_token(self) -> float:
        """Global bytes per token written by decoder layers (V4.1: 356 B by layer 20)."""
        return self.global_bytes_per_token - self.encoder_bytes_per_token

    def global_bytes(self, num_tokens: int) -> int:
        """Exact global bytes after ``num_tokens`` tokens (whole entries only)."""
        return sum(s.bytes_for(num_tokens) for s in self.compressed) + num_tokens * sum(
            d.bytes_per_token for d in self.dense
        )

    # --- per request (fixed) ---

    @property
    def window_bytes_per_request(self) -> int:
        """All layers' window rings (V4.1: 40 × 128 × 528 = 2,703,360 B)."""
        return sum(w.bytes_per_request for w in self.windows)

    @property
    def tail_bytes_per_request(self) -> int:
        """All compressor tails (fp32)."""
        return sum(t.bytes_per_request for t in self.tails)

    def snapshot_bytes(self, num_tokens: int) -> int:
        """Bytes of one window snapshot taken after ``num_tokens`` tokens, as `kvdiet.model.snapshot` writes it.

        Every ring (entries and their int64 positions), per tail its two u32 counts and the kv and score
        rows it holds (`CompressorTailSpec.rows_held`: at a V4-Flash block boundary the CSA layers' last
        complete windows, 1.7 MB at V4-Flash widths), the Engram history (int64,
        ``engram_max_ngram_size − 1`` ids, padded, from the first token on), the magic, length and CRC fields.
        Not counted: the header's JSON (fingerprint and geometry, a few hundred bytes).
        """
        rings = sum(w.window * (w.entry.bytes_per_entry + 8) for w in self.windows)
        tails = sum(8 + 2 * t.rows_held(num_tokens) * t.width * FP32_BYTES for t in self.tails)
        history = 8 * self.engram_history if num_tokens else 0  # padded from the first token
        return SNAPSHOT_FRAME_BYTES + rings + tails + history

    def snapshot_sizes(self) -> Callable[[int], int]:
        """`snapshot_bytes` as a table lookup, for callers that ask per request (the trace study).

        From the first token on, a snapshot's size depends only on the position modulo the least common
        multiple of the tails' ratios.
        """
        period = self.snapshot_period
        table = [self.snapshot_bytes(period + r) for r in range(period)]
        return lambda n: table[n % period] if n > 0 else self.snapshot_bytes(0)

    @property
    def snapshot_period(self) -> int:
        """Tokens after which `snapshot_bytes` repeats from the first token on: the least common multiple of
        the tails' ratios (V4.1-Flash 2, V4-Flash 128; 1 without tails)."""
        return math.lcm(*(t.rows // 2 if t.overlap else t.rows for t in self.tails))

    def snapshots_bytes(self, positions: Sequence[int]) -> int:
        """Σ `snapshot_bytes` over ``positions`` (tokens): one snapshot at each, as a policy persists them.

        A ``range`` of positive positions is summed over one cycle of its residues modulo `snapshot_period`
        (the same sum, in time independent of its length: ``checkpoint:1`` over a million tokens); anything
        else term by term.
        """
        # a range's ends, not min(): min() walks the whole range (a billion positions: half a minute)
        if not isinstance(positions, range) or not positions or min(positions[0], positions[-1]) <= 0:
            return sum(map(self.snapshot_bytes, positions))
        cycle = self.snapshot_period // math.gcd(positions.step, self.snapshot_period)
        whole, rest = divmod(len(positions), cycle)
        head = [self.snapshot_bytes(p) for p in positions[:cycle]]
        return whole * sum(head) + sum(head[:rest])

    @property
    def window_entry_bytes_per_token(self) -> int:
        """Window bytes one token adds across all layers (what storing every token's window costs)."""
        return sum(w.entry.bytes_per_entry for w in self.windows)

    def request_bytes(self, num_tokens: int) -> int:
        """Device bytes of one request at ``num_tokens``: global KV + windows + compressor tails."""
        return self.global_bytes(num_tokens) + self.window_bytes_per_request + self.tail_bytes_per_request


def _dense_spec(cfg: DenseConfig) -> CacheSpec:
    if cfg.kv_lora_rank is not None:
        entry = bf16_format(cfg.kv_lora_rank + (cfg.qk_rope_head_dim or 0))
    else:
        entry = bf16_format(2 * cfg.kv_heads * cfg.kv_head_dim)
    dense = tuple(DenseKVSpec(layer, entry) for layer in range(cfg.num_hidden_layers))
    return CacheSpec(
        cfg.name, (), (), (), dense=dense, encoder_layers=frozenset(range(cfg.num_hidden_layers))
    )
