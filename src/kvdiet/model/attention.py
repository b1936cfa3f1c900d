"""V4.1 attention of one layer: window ∪ selected compressed entries under one softmax (v41-spec §2).

Per layer, with x the normalised layer input and positions absolute:
- ``qr = q_norm(wq_a(x))``, ``q = wq_b(qr)`` as [heads, head_dim], RoPE on the last ``qk_rope_head_dim``.
- window entry ``kv = rope(kv_norm(wkv(x)))`` (one shared latent = key = value), stored FP8 in the ring.
- KV-source layers compress (`Compressor`), write index keys and main-KV entries (RoPE at the group's
  first position, then FP4); index sources score and publish a top-k; Reuse layers take their source's.
- ``o = softmax(q·[window ∪ selected]ᵀ / √head_dim, sink) · [window ∪ selected]``; duplicates between the
  window and the selection count twice, as in DeepSeek's reference; an invalid top-k slot is masked.
- the query-position rotation is undone on ``o``; grouped ``wo_a`` then ``wo_b``.
Window keys older than a segment's ``window_floor`` are never read (bounded replay, v41-spec §7).

The cached path runs on `Segment`s (one per request in the batch); `kvdiet.model.reference` runs the
same projections and `attend` over whole sequences without any cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvdiet.config import ModelConfig
from kvdiet.formats.codec import CacheCodecs
from kvdiet.formats.fp4 import decode_main_kv
from kvdiet.layer_plan import LayerInfo
from kvdiet.model import triton_decode
from kvdiet.model.chain_products import batched_product
from kvdiet.model.compressor import Compressor
from kvdiet.model.index_scores import StoredKeys, index_scores, index_scores_at
from kvdiet.model.indexer import Indexer
from kvdiet.model.layers import RMSNorm, Rope, Rotation, as_dtype
from kvdiet.model.linear import Linear
from kvdiet.model.narrow_softmax import softmax_last
from kvdiet.model.row_tables import RowTables
from kvdiet.model.segment import Segment
from kvdiet.model.selection import (
    candidate_entries,
    select_candidate_blocks,
    select_topk,
    select_topk_at,
    visible_entries,
)

if TYPE_CHECKING:
    from kvdiet.model.decode_step import DecodePlan

__all__ = ["Attention", "Segment", "Selection", "attend", "grouped_product"]

# Bytes of fp32 keys one attention block reads per query block (each query's window band and its gathered
# top-k entries): they stay in the last-level cache between the score and the value products. At V4.1's widths
# (window 128, top-512, 512 dims) that is 6 query rows (8 rows were 6× faster than 64 on a 32 MiB L3); at small
# widths a whole prompt is one block.
_ATTEND_BUDGET = 8 << 20
# Scores materialised at once by `Attention.select`: query rows × scored entries (64 MiB as fp32).
_SCORE_BUDGET = 1 << 24


def attend(
    q: torch.Tensor,
    win_kv: torch.Tensor,
    win_mask: torch.Tensor,
    comp_kv: torch.Tensor | None,
    comp_mask: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One softmax over window keys, selected compressed keys and the sink (value 0).

    Args:
        q: fp32 [B, H, D] queries.
        win_kv: fp32 [L, D] window entries shared by the queries (the no-cache reference), or [B, L, D] each
            query's own (its window band in a prefill, its request's window in a batched decode step); may
            be a strided view; ``win_mask`` bool [B, L].
        comp_kv: fp32 [B, K, D] per-query selected entries (or None); ``comp_mask`` bool [B, K].
        sink: fp32 [H] per-head sink logits.
        scale: softmax scale (head_dim^-½).
    Returns:
        fp32 [B, H, D].
    """
    b, h, d = q.shape
    shared = win_kv.dim() == 2
    win = (
        (q.reshape(b * h, d) @ win_kv.T).view(b, h, -1)
        if shared
        else batched_product(q, win_kv.transpose(1, 2))
    )
    parts = [win.mul_(scale).masked_fill_(~win_mask[:, None, :], float("-inf"))]
    if comp_kv is not None:
        lc = batched_product(q, comp_kv.transpose(1, 2)).mul_(scale)
        parts.append(lc.masked_fill_(~comp_mask[:, None, :], float("-inf")))
    parts.append(as_dtype(sink, torch.float32)[None, :, None].expand(b, h, 1))
    probs = softmax_last(torch.cat(parts, dim=-1))
    n_win = win_kv.shape[-2]
    if shared:
        out = (probs[..., :n_win].reshape(b * h, n_win) @ win_kv).view(b, h, d)
    else:  # torch.bmm's bits (compiled where checked: `kvdiet.model.chain_products`)
        out = batched_product(probs[..., :n_win], win_kv)
    if comp_kv is not None:
        out += batched_product(probs[..., n_win : n_win + comp_kv.shape[1]], comp_kv)
    return out


def _band_mask(w: int, win_pos: torch.Tensor, pos: torch.Tensor, floor: int, first: int) -> torch.Tensor:
    """`Attention.window_band`'s mask bool [T, w]: the band slots' positions (``win_pos`` int64 [L] after w − 1
    padding slots at −1, query 0's band from padded slot ``first``) in ``[max(pos − w + 1, floor), pos]``."""
    padded_pos = torch.cat([win_pos.new_full((w - 1,), -1), win_pos])
    band_pos = padded_pos.as_strided((pos.shape[0], w), (1, 1), first)
    lo = torch.clamp(pos - w + 1, min=floor)[:, None]
    return (band_pos >= lo) & (band_pos <= pos[:, None]) & (band_pos >= 0)


def grouped_product(o: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``einsum("tgd,grd->tgr", o, w)`` → [T, G, R] for a contiguous ``o`` [T, G, D] and ``w`` [G, R, D]: the one
    ``bmm`` einsum runs, over the same operand views (so the same values bit for bit), without einsum's
    equation parsing (~20 µs a call, once per layer in a decode step). Other layouts of ``o`` are not einsum's
    operands."""
    t, g, d = o.shape
    left = o.view(g, 1, d) if t == 1 else o.transpose(0, 1)  # einsum's [G, T, D] operand
    return torch.bmm(left, w.transpose(1, 2)).transpose(0, 1)


@dataclass(frozen=True, slots=True)
class Selection:
    """What a compressed layer's rows attend, with what an analysis needs to recompute it off the hot path.

    Attributes:
        attn: the layer (``attn.info`` its roles; ``attn.indexer`` None on Reuse layers).
        seg: the rows' request segment (``seg.positions`` int64 [T], ``seg.state`` its caches, ``seg.topk``
            the top-k published so far in this call).
        x: fp32 [T, hidden] the layer's normalised input; ``qr`` fp32 [T, q_lora_rank]; ``q`` fp32 [T, H, D]
            the attention queries after RoPE.
        idx / valid: int64 / bool [T, k], the compressed entries each row attends (of ``attn.info.kv_src``).
    """

    attn: Attention
    seg: Segment
    x: torch.Tensor
    qr: torch.Tensor
    q: torch.Tensor
    idx: torch.Tensor
    valid: torch.Tensor


class Attention(nn.Module):
    """Attention of one layer; parameter names follow DeepSeek's checkpoint (``layers.{i}.attn.*``)."""

    def __init__(self, cfg: ModelConfig, info: LayerInfo, codecs: CacheCodecs) -> None:
        super().__init__()
        h, d = cfg.num_attention_heads, cfg.head_dim
        self.info, self.codecs = info, codecs
        self.n_heads, self.head_dim, self.n_groups = h, d, cfg.o_groups
        self.window, self.index_topk = cfg.sliding_window, cfg.index_topk
        self.candidate_block_size, self.candidate_topk_blocks = (
            cfg.candidate_block_size,
            cfg.candidate_topk_blocks,
        )
        self.scale = d**-0.5
        self.rope = Rope.for_layer(cfg, info.compress_ratio)
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, h * d)
        self.wkv = Linear(cfg.hidden_size, d)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = Linear(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size)
        self.attn_sink = nn.Parameter(torch.zeros(h))
        # Called with a `Selection` of each call's rows on compressed layers (`kvdiet golden` and `kvdiet
        # fidelity` set it; None otherwise).
        self.selection_observer: Callable[[Selection], None] | None = None
        self.compressor = (
            Compressor(cfg.hidden_size, d, info.compress_ratio, cfg.rms_norm_eps)
            if info.owns_compressed_kv
            else None
        )
        self.indexer = (
            Indexer(
                hidden_size=cfg.hidden_size,
                q_lora_rank=cfg.q_lora_rank,
                head_dim=d,
                n_heads=cfg.index_n_heads,
                index_head_dim=cfg.index_head_dim,
                owns_keys=info.owns_index_keys,
                eps=cfg.rms_norm_eps,
            )
            if info.owns_indexer
            else None
        )

    # --- pure projections (shared with the no-cache reference) ---

    def project_q(self, x: torch.Tensor, rot: Rotation) -> tuple[torch.Tensor, torch.Tensor]:
        """``(qr fp32 [T, q_lora_rank], q fp32 [T, H, D] after RoPE)``; ``rot``: ``self.rope.at(positions [T])``."""
        qr = self.q_norm(self.wq_a(x))
        q = as_dtype(self.wq_b(qr), torch.float32).view(-1, self.n_heads, self.head_dim)
        return qr, rot.apply(q.transpose(0, 1)).transpose(0, 1)

    def project_window_kv(self, x: torch.Tensor, rot: Rotation) -> torch.Tensor:
        """Window entries fp32 [T, D] after RoPE (``rot``: ``self.rope.at(positions [T])``), before storage."""
        return rot.apply(self.kv_norm(self.wkv(x)))

    def compressed_entries(self, latent: torch.Tensor, rot: Rotation) -> torch.Tensor:
        """Main-KV entries fp32 [M, D] before storage; ``rot``: ``self.rope.at(group_ids [M] · r)``, each
        group's first position."""
        return rot.apply(latent)

    def project_out(self, o: torch.Tensor, rot: Rotation) -> torch.Tensor:
        """Undo the query rotation ``rot`` on ``o`` [T, H, D], grouped ``wo_a``, then ``wo_b`` → fp32 [T, hidden]."""
        o = rot.apply(o.transpose(0, 1), inverse=True).transpose(0, 1)
        t, g = o.shape[0], self.n_groups
        o = o.reshape(t, g, -1)
        wo_a = self.wo_a.dense_weight().view(g, -1, o.shape[-1])
        return self.wo_b(grouped_product(o, wo_a).reshape(t, -1))

    def window_mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor, floor: int) -> torch.Tensor:
        """bool [Q, L]: key position in ``[max(t − W + 1, floor), t]`` for query position t."""
        lo = torch.clamp(q_pos - self.window + 1, min=floor)
        return (k_pos[None, :] >= lo[:, None]) & (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= 0)

    # --- cached path ---

    def forward(
        self, x: torch.Tensor, seg: Segment | list[Segment], plan: DecodePlan | None = None
    ) -> torch.Tensor:
        """Write this layer's global entries for ``x`` [T, hidden], then attend; returns fp32 [T, hidden].

        With a decode step's ``plan``, ``seg`` is the list of the batch's segments (one row each, ``x`` [B,
        hidden]) and the whole batch runs at once (`kvdiet.model.decode_step.decode_attention`).
        """
        if plan is not None:
            return plan.attend(self, x, seg)
        self.update_global(x, seg)
        return self.attend_rows(x, seg)

    def update_global(self, x: torch.Tensor, seg: Segment) -> None:
        """KV-source layers: compress the rows and append index keys and main-KV entries to the request's caches.

        Entries the request already holds (rows replayed after a prefix hit) are computed by the compressor
        but not written again; an entry completed by a replayed row past the held ones is written (B03).
        """
        if self.compressor is None:
            return
        layer, state = self.info.layer_id, seg.state
        latent, gids = self.compressor(x, seg.start_pos, state.tails.get(layer))
        new = state.main[layer].unheld(gids)  # a replay: never rewrite entries the request holds (B03)
        latent, gids = latent[new], gids[new]
        if gids.numel():
            rot = self.rope.at(gids * self.info.compress_ratio)  # each group's first position
            state.index_keys[layer].append(self.indexer.keys(latent, rot))
            state.main[layer].append(self.compressed_entries(latent, rot))

    def attend_rows(self, x: torch.Tensor, seg: Segment) -> torch.Tensor:
        """Attention for rows ``x`` [T, hidden] at ``seg.positions`` (global caches already up to date)."""
        pos, info, state = seg.positions, self.info, seg.state
        rot = seg.tables.rotation(self.rope, pos)
        qr, q = self.project_q(x, rot)
        kv = self.codecs.window.roundtrip(self.project_window_kv(x, rot))
        ring = state.windows[info.layer_id]
        win_kv, win_pos = kv, pos  # from position 0 no ring entry is older than the rows
        if seg.start_pos > 0:
            ring_kv, ring_pos = ring.read()
            older = ring_pos < seg.start_pos
            order = torch.argsort(ring_pos[older])
            win_kv = torch.cat([ring_kv[older][order], kv])
            win_pos = torch.cat([ring_pos[older][order], pos])
        ring.write(kv, pos)
        if self.indexer is not None:
            q_idx, w = self.indexer.queries(qr, x, rot, self.codecs.index_key)
            seg.topk[info.layer_id] = self.select(q_idx, w, seg)
        if self.selection_observer is not None and info.compress_ratio:
            self.selection_observer(Selection(self, seg, x, qr, q, *seg.topk[info.idx_src]))
        band_kv, band_mask = self.window_band(win_kv, win_pos, pos, seg.window_floor, seg.tables)
        t = pos.shape[0]
        o = torch.empty(t, self.n_heads, self.head_dim, device=q.device)
        k = self.index_topk if info.compress_ratio else 0
        rows = max(1, _ATTEND_BUDGET // ((self.window + k) * self.head_dim * 4))
        for s in range(0, t, rows):
            e = min(t, s + rows)
            comp = comp_mask = None
            if info.compress_ratio:
                idx, valid = seg.topk[info.idx_src]
                store = seg.state.main[info.kv_src]
                if q.is_cuda and store.codec.decode is decode_main_kv and triton_decode.available():
                    packed = seg.state.table.pool.rows(info.kv_src, "main")  # read in place
                    slots = store.slots(idx[s:e])
                    o[s:e] = triton_decode.attend_packed(
                        q[s:e],
                        band_kv[s:e],
                        band_mask[s:e],
                        packed,
                        slots,
                        valid[s:e],
                        self.attn_sink,
                        self.scale,
                    )
                    continue
                comp, comp_mask = self._gather_main(seg, idx[s:e]), valid[s:e]
            out = attend(q[s:e], band_kv[s:e], band_mask[s:e], comp, comp_mask, self.attn_sink, self.scale)
            if e - s == t and out.dtype == o.dtype:  # one block (a whole prompt at small widths): no copy
                o = out
            else:
                o[s:e] = out
        return self.project_out(o, rot)

    def window_band(
        self,
        win_kv: torch.Tensor,
        win_pos: torch.Tensor,
        pos: torch.Tensor,
        floor: int,
        tables: RowTables | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query's own window: ``(fp32 [T, W, D], bool [T, W])``, a view of ``win_kv`` and its mask.

        ``win_kv`` [L, D] holds entries at ascending distinct positions ``win_pos`` int64 [L] (−1: empty, at
        the front), ending with the T query rows at ``pos``. The keys query i may read (positions in
        ``[max(pos[i] − W + 1, floor), pos[i]]``) are then a run of at most W rows ending at its own row: row
        ``L − T + i``. Query i's band is the W rows ending there (the rows before the first are W − 1 padding
        rows at position −1); the mask keeps the readable ones (`window_mask` of each query alone). With
        ``tables`` (the rows' `RowTables`) and L = T (no entry before the rows), the mask, then a function of
        ``pos``, W and ``floor`` alone, is the one ``tables`` keeps (read-only).
        """
        w, (n, d), t = self.window, win_kv.shape, pos.shape[0]
        padded = torch.cat([win_kv.new_zeros(w - 1, d), win_kv])
        first = n - t  # padded row of query 0's oldest band slot: (n − t + w − 1) − (w − 1)
        band = padded.as_strided((t, w, d), (d, d, 1), first * d)
        if tables is not None and first == 0:
            return band, tables.band_mask(w, floor, lambda: _band_mask(w, win_pos, pos, floor, first))
        return band, _band_mask(w, win_pos, pos, floor, first)

    def _gather_main(self, seg: Segment, idx: torch.Tensor) -> torch.Tensor:
        """Decoded main-KV entries of ``kv_src`` at ``idx`` [B, k] → fp32 [B, k, D]; decodes the whole
        source once per call when the call selects more entries than it holds."""
        src = self.info.kv_src
        store = seg.state.main[src]
        full = seg.decoded_main.get(src)
        if full is None and seg.positions.shape[0] * self.index_topk > len(store):
            full = seg.decoded_main[src] = store.read()
        if full is None:
            return store.read(idx)
        return full.index_select(0, idx.flatten()).view(*idx.shape, self.head_dim)

    def select(self, q_idx: torch.Tensor, w: torch.Tensor, seg: Segment) -> tuple[torch.Tensor, torch.Tensor]:
        """This index source's top-k for the segment's rows, from their index queries ``q_idx`` fp32 [T, H, d]
        and head weights ``w`` fp32 [T, H] (`Indexer.queries`); on the candidate source it also publishes
        the candidate pool. Returns ``(idx int64 [T, k], valid bool [T, k])`` as `select_topk`.

        Scores are read from the stored keys (`StoredKeys`); a candidate consumer scores only its pool.
        Raises RuntimeError when a consumer finds no published pool."""
        info, pos = self.info, seg.positions
        keys = StoredKeys.of(seg.state.index_keys[info.kv_src])
        n, t = keys.num_entries, pos.shape[0]
        limit = visible_entries(pos, n, info.compress_ratio)
        entries = None
        if info.candidate == "consumer":
            if seg.candidates is None:
                raise RuntimeError(f"layer {info.layer_id} consumes candidates but none were published")
            entries = candidate_entries(*seg.candidates, block_size=self.candidate_block_size)
        k = min(self.index_topk, n)
        idx = torch.zeros(t, k, dtype=torch.int64)
        valid = torch.zeros(t, k, dtype=torch.bool)
        cand_blocks: list[tuple[torch.Tensor, torch.Tensor]] = []
        step = max(1, _SCORE_BUDGET // max(1, n if entries is None else entries.shape[1]))
        for s in range(0, t, step):
            e = min(t, s + step)
            if entries is not None:
                scores = index_scores_at(q_idx[s:e], w[s:e], keys, entries[s:e], limit[s:e])
                idx[s:e], valid[s:e] = select_topk_at(scores, entries[s:e], self.index_topk, n)
                continue
            scores = index_scores(q_idx[s:e], w[s:e], keys, limit[s:e])
            if info.candidate == "source":
                cand_blocks.append(
                    select_candidate_blocks(
                        scores,
                        limit[s:e],
                        block_size=self.candidate_block_size,
                        topk_blocks=self.candidate_topk_blocks,
                    )
                )
            idx[s:e], valid[s:e] = select_topk(scores, self.index_topk)
        if cand_blocks:
            seg.candidates = (torch.cat([c[0] for c in cand_blocks]), torch.cat([c[1] for c in cand_blocks]))
        return idx, valid
