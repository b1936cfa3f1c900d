"""V4-Flash's attention layer: sliding window on every layer, plus all visible compressed entries (HCA) or
the indexer's top-k of them (CSA), in one softmax with a per-head sink (v41-spec §2, §9).

DeepSeek's V4 reference ``Attention``; transformers ``DeepseekV4Attention``. For rows x (the layer's normed
input) at positions t:
```
qr = q_norm(wq_a(x));  q = rmsnorm_per_head(wq_b(qr).view(H, D));  q = rope(q, t)   # no weight on the head norm
kv = rope(kv_norm(wkv(x)), t)                                                   # one K=V head
keys = window (positions t−W+1 … t) ++ compressed entries the query may attend
o = softmax(q·keysᵀ / √D ∪ sink) · keys;  o = rope⁻¹(o, t)
out = wo_b(concat over o_groups of wo_a_g(o_g))
```
HCA (ratio 128) attends every entry whose window is complete (``j < (t+1)//128``); CSA (ratio 4) attends the
indexer's selection. SWA-only layers use base ``rope_theta``; compressed layers ``compress_rope_theta`` with
YaRN (`Rope.for_layer`).

Caches are packed as V4-Flash stores them (``codecs``, `CacheCodecs.for_v4`): window entries and compressed
entries in the 584-B FP8 record, index keys Hadamard-rotated in MXFP4; a value is rounded when it is written
and every read, the writing token's own included, sees the stored value. ``codecs=None`` keeps them exact,
in the compute dtype (the peer tests against transformers, which does not quantise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvdiet.config import ModelConfig
from kvdiet.formats.codec import CacheCodecs, Codec
from kvdiet.model.layers import RMSNorm, Rope, widen
from kvdiet.model.linear import Linear
from kvdiet.model.v4.compressor import CompressorState, V4Compressor
from kvdiet.model.v4.indexer import V4Indexer, hadamard

__all__ = ["V4Attention", "V4LayerCache"]


@dataclass
class V4LayerCache:
    """One request's caches of one V4 layer: stored rows, packed uint8 [n, bytes per entry] or exact values
    [n, dim] in the compute dtype.

    Attributes:
        window: K=V of the last n ≤ window − 1 tokens (after RoPE), oldest first.
        entries: compressed KV entries 0 … N − 1 (after norm and RoPE); empty on SWA-only layers.
        index_keys: the indexer's keys, one per entry (CSA only; packed: Hadamard-rotated MXFP4).
        compressor / index_compressor: open-window rows (`CompressorState`), None where absent.
    """

    window: torch.Tensor
    entries: torch.Tensor
    index_keys: torch.Tensor
    compressor: CompressorState | None = None
    index_compressor: CompressorState | None = None

    def nbytes(self) -> dict[str, int]:
        """Bytes held by kind: ``window``, ``entries``, ``index_keys``, ``state`` (open-window rows)."""

        def size(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        states = [s for s in (self.compressor, self.index_compressor) if s is not None]
        return {
            "window": size(self.window),
            "entries": size(self.entries),
            "index_keys": size(self.index_keys),
            "state": sum(s.nbytes() for s in states),
        }


class V4Attention(nn.Module):
    """One V4 attention layer (DeepSeek names under ``layers.{i}.attn.``): ``wq_a``, ``q_norm``, ``wq_b``,
    ``wkv``, ``kv_norm``, ``wo_a`` [o_groups·o_lora_rank, H·D/o_groups], ``wo_b``, ``attn_sink`` fp32 [H];
    ``compressor`` on ratio > 0 layers; ``indexer`` on CSA layers (ratio 4).

    Args:
        cfg: a V4 config; ratio: this layer's ``compress_ratios`` entry (0, 4 or 128).
        codecs: the packed cache codecs, or None for exact caches.
    """

    def __init__(self, cfg: ModelConfig, ratio: int, codecs: CacheCodecs | None) -> None:
        super().__init__()
        self.codecs = codecs
        self.ratio, self.window = ratio, cfg.sliding_window
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.o_groups, self.eps = cfg.o_groups, cfg.rms_norm_eps
        self.rope = Rope.for_layer(cfg, ratio)
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.wkv = Linear(cfg.hidden_size, self.head_dim)
        self.kv_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.wo_a = Linear(self.n_heads * self.head_dim // self.o_groups, self.o_groups * cfg.o_lora_rank)
        self.wo_b = Linear(self.o_groups * cfg.o_lora_rank, cfg.hidden_size)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads))
        self.compressor = (
            V4Compressor(cfg.hidden_size, self.head_dim, ratio, overlap=ratio == 4, eps=cfg.rms_norm_eps)
            if ratio
            else None
        )
        self.indexer = (
            V4Indexer(
                hidden_size=cfg.hidden_size,
                q_lora_rank=cfg.q_lora_rank,
                n_heads=cfg.index_n_heads,
                head_dim=cfg.index_head_dim,
                ratio=ratio,
                topk=cfg.index_topk,
                eps=cfg.rms_norm_eps,
            )
            if ratio == 4
            else None
        )

    def new_cache(self, dtype: torch.dtype = torch.float32) -> V4LayerCache:
        """Empty caches of one request (``dtype``: the compute dtype, for exact caches)."""
        d, di = self.head_dim, self.indexer.head_dim if self.indexer is not None else 0
        c = self.codecs

        def rows(codec: Codec | None, dim: int) -> torch.Tensor:
            return (
                torch.empty(0, codec.width, dtype=codec.dtype) if codec else torch.empty(0, dim, dtype=dtype)
            )

        return V4LayerCache(
            window=rows(c and c.window, d),
            entries=rows(c and c.main, d),
            index_keys=rows(c and c.index_key, di),
            compressor=CompressorState.empty(self.compressor.width, dtype) if self.compressor else None,
            index_compressor=(
                CompressorState.empty(self.indexer.compressor.width, dtype) if self.indexer else None
            ),
        )

    def forward(self, x: torch.Tensor, start_pos: int, cache: V4LayerCache) -> torch.Tensor:
        """Attention output [T, hidden] of rows x [T, hidden] at positions ``start_pos …`` (caches updated).

        Raises:
            ValueError: the caches do not end at ``start_pos`` (see `V4Compressor.forward`).
        """
        x = widen(x)
        t, h, d = x.shape[0], self.n_heads, self.head_dim
        pos = torch.arange(start_pos, start_pos + t)
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).view(t, h, d)
        q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + self.eps)
        q = self.rope.rotate(q.transpose(0, 1), pos).transpose(0, 1)  # [T, H, D]
        kv_rows, kv = self._store("window", self.rope.rotate(self.kv_norm(self.wkv(x)), pos))  # [T, D]

        held = cache.window.shape[0]
        keys = torch.cat([self._load("window", cache.window, kv.dtype), kv])  # positions start_pos − held …
        key_pos = torch.arange(start_pos - held, start_pos + t)
        mask = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] > pos[:, None] - self.window)
        if self.compressor is not None:
            new, _ = self.compressor(x, start_pos, cache.compressor, self.rope)
            cache.entries = torch.cat([cache.entries, self._store("main", new)[0]])
            entries = self._load("main", cache.entries, kv.dtype)
            visible = torch.arange(entries.shape[0])[None, :] < ((pos + 1) // self.ratio)[:, None]
            if self.indexer is not None:
                new_keys, _ = self.indexer.compressor(x, start_pos, cache.index_compressor, self.rope)
                if self.codecs is not None:
                    new_keys = hadamard(new_keys)
                cache.index_keys = torch.cat([cache.index_keys, self._store("index_key", new_keys)[0]])
                index_keys = self._load("index_key", cache.index_keys, kv.dtype)
                codec = self.codecs.index_key if self.codecs is not None else None
                scores = self.indexer.scores(qr, x, pos, index_keys, self.rope, codec)
                picks = self.indexer.select(scores, pos)
                chosen = torch.zeros(t, entries.shape[0] + 1, dtype=torch.bool)
                chosen.scatter_(1, picks.where(picks >= 0, entries.shape[0]), True)
                visible &= chosen[:, :-1]
            keys = torch.cat([keys, entries])
            mask = torch.cat([mask, visible], dim=1)
        keep = self.window - 1
        cache.window = torch.cat([cache.window, kv_rows])[-keep:].clone() if keep else cache.window[:0]

        logits = torch.einsum("thd,nd->thn", q, keys) * d**-0.5
        logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
        sink = self.attn_sink.to(logits.dtype)[None, :, None].expand(t, h, 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        o = torch.einsum("thn,nd->thd", probs, keys)
        o = self.rope.rotate(o.transpose(0, 1), pos, inverse=True).transpose(0, 1)  # [T, H, D]
        groups = o.reshape(t, self.o_groups, -1)  # [T, G, H·D/G]
        w = self.wo_a.dense_weight().to(o.dtype).view(self.o_groups, -1, groups.shape[-1])
        grouped = torch.einsum("tgi,goi->tgo", groups, w).flatten(1)
        return self.wo_b(grouped)

    def _store(self, kind: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows to store, the values a read gives back)`` of vectors x [n, dim] under codec ``kind``."""
        codec = getattr(self.codecs, kind) if self.codecs is not None else None
        if codec is None:
            return x, x
        rows = codec.encode(x.float())
        return rows, codec.decode(rows).to(x.dtype)

    def _load(self, kind: str, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows of codec ``kind`` as values [n, dim] in ``dtype``."""
        codec = getattr(self.codecs, kind) if self.codecs is not None else None
        if codec is None:
            return rows.to(dtype)
        return codec.decode(rows).to(dtype) if rows.shape[0] else torch.empty(0, codec.dim, dtype=dtype)
