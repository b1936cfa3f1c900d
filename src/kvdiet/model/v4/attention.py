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

Caches live in the request's `RequestState`, packed as V4-Flash stores them (`CacheCodecs.for_v4`): window
entries in a 128-slot ring and compressed entries in the paged device pool, both in the 584-B FP8 record,
index keys Hadamard-rotated in MXFP4; a value is rounded when it is written and every read, the writing
token's own included, sees the stored value. Exact codecs keep them unquantised (the peer tests against
transformers, which does not quantise). A replayed chunk (after `V4Transformer.rewind`) recomputes entries
the request already holds without writing them again.
"""

from __future__ import annotations

import torch
from torch import nn

from kvdiet.config import ModelConfig
from kvdiet.formats.codec import CacheCodecs
from kvdiet.model.layers import RMSNorm, Rope, widen
from kvdiet.model.linear import Linear
from kvdiet.model.state import PagedEntries, RequestState
from kvdiet.model.v4.compressor import V4Compressor
from kvdiet.model.v4.indexer import V4Indexer, hadamard

__all__ = ["V4Attention"]


class V4Attention(nn.Module):
    """One V4 attention layer (DeepSeek names under ``layers.{i}.attn.``): ``wq_a``, ``q_norm``, ``wq_b``,
    ``wkv``, ``kv_norm``, ``wo_a`` [o_groups·o_lora_rank, H·D/o_groups], ``wo_b``, ``attn_sink`` fp32 [H];
    ``compressor`` on ratio > 0 layers; ``indexer`` on CSA layers (ratio 4).

    Args:
        cfg: a V4 config; ratio: this layer's ``compress_ratios`` entry (0, 4 or 128).
        codecs: the cache codecs (`CacheCodecs.for_v4`: packed, or exact).
    """

    def __init__(self, cfg: ModelConfig, ratio: int, codecs: CacheCodecs) -> None:
        super().__init__()
        self.codecs, self.packed = codecs, codecs.main.dtype == torch.uint8
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

    @property
    def tail_width(self) -> int:
        """Columns of this layer's compressor tail: the main compressor's, then the indexer's (0: no tail)."""
        if self.compressor is None:
            return 0
        return self.compressor.width + (self.indexer.compressor.width if self.indexer is not None else 0)

    def forward(self, x: torch.Tensor, start_pos: int, state: RequestState, layer: int) -> torch.Tensor:
        """Attention output [T, hidden] of rows x [T, hidden] at positions ``start_pos …``; writes this layer's
        window ring, compressor tail, entries and index keys in ``state``.

        Raises:
            ValueError: the tail does not end at ``start_pos`` (see `V4Compressor.forward`).
        """
        x = widen(x)
        t, h, d = x.shape[0], self.n_heads, self.head_dim
        pos = torch.arange(start_pos, start_pos + t)
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).view(t, h, d)
        q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + self.eps)
        q = self.rope.rotate(q.transpose(0, 1), pos).transpose(0, 1)  # [T, H, D]
        kv = self.rope.rotate(self.kv_norm(self.wkv(x)), pos)
        ring = state.windows[layer]
        kv = ring.codec.roundtrip(kv.float() if self.packed else kv).to(x.dtype)  # as the ring stores it
        old, old_pos = ring.read()
        keep = old_pos > start_pos - self.window
        keys = torch.cat([old[keep].to(x.dtype), kv])
        key_pos = torch.cat([old_pos[keep], pos])
        mask = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] > pos[:, None] - self.window)
        ring.write(kv, pos)
        # keys every row shares (window, HCA entries) [n, D] with mask [T, n]; keys of each row's own (CSA: the
        # indexer's picks, gathered) [T, k, D] with mask [T, k]
        picked, picked_mask = keys.new_empty(t, 0, d), torch.zeros(t, 0, dtype=torch.bool)
        if self.compressor is not None:
            self._compress(x, pos, state, layer)
            entries = state.main[layer]
            if self.indexer is None:  # HCA: every entry whose window is complete
                keys = torch.cat([keys, entries.read().to(x.dtype)])
                visible = torch.arange(len(entries))[None, :] < ((pos + 1) // self.ratio)[:, None]
                mask = torch.cat([mask, visible], dim=1)
            else:  # CSA: only the entries the indexer picks (−1: none)
                keys_i = state.index_keys[layer].read().to(x.dtype)
                codec = self.codecs.index_key if self.packed else None
                picks = self.indexer.select(self.indexer.scores(qr, x, pos, keys_i, self.rope, codec), pos)
                picked_mask = picks >= 0
                picked = entries.read(picks.clamp(min=0)).to(x.dtype)

        scale = d**-0.5
        logits = torch.cat(
            [torch.einsum("thd,nd->thn", q, keys) * scale, torch.einsum("thd,tkd->thk", q, picked) * scale],
            dim=-1,
        )
        logits = logits.masked_fill(~torch.cat([mask, picked_mask], dim=1)[:, None, :], float("-inf"))
        sink = self.attn_sink.to(logits.dtype)[None, :, None].expand(t, h, 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        n = keys.shape[0]
        o = torch.einsum("thn,nd->thd", probs[..., :n], keys) + torch.einsum(
            "thk,tkd->thd", probs[..., n:], picked
        )
        o = self.rope.rotate(o.transpose(0, 1), pos, inverse=True).transpose(0, 1)  # [T, H, D]
        groups = o.reshape(t, self.o_groups, -1)  # [T, G, H·D/G]
        w = self.wo_a.dense_weight().to(o.dtype).view(self.o_groups, -1, groups.shape[-1])
        grouped = torch.einsum("tgi,goi->tgo", groups, w).flatten(1)
        return self.wo_b(grouped)

    def _compress(self, x: torch.Tensor, pos: torch.Tensor, state: RequestState, layer: int) -> None:
        """Run the compressor (and the indexer's) and append the entries the request does not hold yet."""
        start, tail = int(pos[0]), state.tails[layer]
        new, ids = self.compressor(x, start, tail, slice(0, self.compressor.width), self.rope)
        _append_new(state.main[layer], new, ids)
        if self.indexer is not None:
            index_cols = slice(self.compressor.width, self.tail_width)
            keys, ids = self.indexer.compressor(x, start, tail, index_cols, self.rope)
            _append_new(state.index_keys[layer], hadamard(keys) if self.packed else keys, ids)
        tail.count = (start + x.shape[0]) % self.ratio


def _append_new(entries: PagedEntries, values: torch.Tensor, ids: torch.Tensor) -> None:
    """Append ``values`` [M, dim] of entry ids ``ids`` [M] that ``entries`` does not hold yet
    (`PagedEntries.unheld`; a packed codec encodes fp32)."""
    new = entries.unheld(ids)
    if bool(new.any()):
        packed = entries.codec.dtype == torch.uint8
        entries.append(values[new].float() if packed else values[new])
