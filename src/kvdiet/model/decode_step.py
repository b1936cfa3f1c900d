"""One V4.1 decode step for a batch of requests: each layer's attention in one set of tensor ops.

`Attention.forward` runs one request's rows at a time; in a decode step every request brings one row, so
the batch is a loop of B tiny calls per layer. Here the projections, the window-ring read, the index
queries, top-k, the gather of selected entries and the softmax run once over the batch ([B, …] tensors,
ragged lengths padded and masked); only what lives in each request's own storage (its ring and compressor
tail, its cache blocks, its index-key scores) is touched per request. Per step, `DecodePlan` computes the
positions and ring slots once for every layer and keeps each (KV source, top-k source) pair's gathered
entries for the Reuse layers that read the same ones.

Same results as the per-request path up to fp32 reassociation (batched matmuls): the same entries are
read and written, every selection is the same function of the same scores, padding is masked (−inf).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvdiet.model.attention import Attention, Segment, Selection, attend
from kvdiet.model.compressor import pool_groups
from kvdiet.model.index_scores import StoredKeys, index_scores
from kvdiet.model.selection import select_candidate_blocks, select_topk, visible_entries

__all__ = ["DecodePlan", "decode_attention"]


@dataclass(slots=True)
class DecodePlan:
    """What every layer of one decode step shares.

    Attributes:
        positions: int64 [B], the new row's position per request.
        ring_slots: int64 [B, W−1], ring slot of each older window position ``t−W+1 … t−1``.
        ring_rows: int64 [B·(W−1)], those slots as rows of the batch's rings stacked ``[B·W, …]``.
        fresh_rows: int64 [B, 1], row ``B·W + b`` (request b's new entry, stacked after the rings).
        fresh_open: bool [B, 1], all True (the new entry is always read).
        ring_positions: int64 [B, W−1], those positions.
        ring_open: bool [B, W−1], positions a query may read (≥ 0 and ≥ the request's window floor).
        gathered: ``{(kv_src, idx_src): (entries fp32 [B, K, D], valid bool [B, K])}`` filled during the step.
    """

    positions: torch.Tensor
    ring_slots: torch.Tensor
    ring_rows: torch.Tensor
    fresh_rows: torch.Tensor
    fresh_open: torch.Tensor
    ring_positions: torch.Tensor
    ring_open: torch.Tensor
    gathered: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def for_segments(cls, segs: list[Segment], window: int) -> DecodePlan:
        """The plan of segments holding one row each, for a sliding window of ``window`` tokens."""
        pos = torch.cat([s.positions for s in segs])
        older = pos[:, None] - (window - 1) + torch.arange(window - 1, device=pos.device)
        floors = torch.tensor([s.window_floor for s in segs], device=pos.device)
        slots, batch = older % window, torch.arange(len(segs), device=pos.device)[:, None]
        rows = (slots + window * batch).flatten()
        fresh, fresh_open = len(segs) * window + batch, torch.ones_like(batch, dtype=torch.bool)
        return cls(pos, slots, rows, fresh, fresh_open, older, (older >= 0) & (older >= floors[:, None]))

    def attend(self, attn: Attention, x: torch.Tensor, segs: list[Segment]) -> torch.Tensor:
        """`decode_attention` of this step (what `Attention.forward` calls when given the plan)."""
        return decode_attention(attn, x, segs, self)


def decode_attention(attn: Attention, x: torch.Tensor, segs: list[Segment], plan: DecodePlan) -> torch.Tensor:
    """`Attention.forward` of one row per request: ``x`` fp32 [B, hidden] → fp32 [B, hidden].

    Writes each request's global entries and window entry as `Attention.forward` does and publishes the
    same top-k (and candidate blocks) in each segment.
    """
    info, pos = attn.info, plan.positions
    if attn.compressor is not None:
        _update_global(attn, x, segs, pos)
    qr, q = attn.project_q(x, pos)
    codec = attn.codecs.window
    kv = codec.roundtrip(attn.project_window_kv(x, pos))
    win_kv, win_mask = _window(attn, segs, plan, kv)
    if attn.indexer is not None:
        _select(attn, qr, x, segs, pos)
    if attn.selection_observer is not None and info.compress_ratio:
        for b, seg in enumerate(segs):
            attn.selection_observer(
                Selection(attn, seg, x[b : b + 1], qr[b : b + 1], q[b : b + 1], *seg.topk[info.idx_src])
            )
    comp = comp_mask = None
    if info.compress_ratio:
        key = (info.kv_src, info.idx_src)
        if key not in plan.gathered:
            plan.gathered[key] = _gather_main(attn, segs)
        comp, comp_mask = plan.gathered[key]
    o = attend(q, win_kv, win_mask, comp, comp_mask, attn.attn_sink, attn.scale)
    return attn.project_out(o, pos)


def _window(
    attn: Attention, segs: list[Segment], plan: DecodePlan, kv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Window keys fp32 [B, W, D] in position order (the ring's older ones, then ``kv`` [B, D]) and their
    mask; then each ring stores its request's new entry."""
    layer, codec = attn.info.layer_id, attn.codecs.window
    rings = [seg.state.windows[layer] for seg in segs]
    rows, positions = _batched([r.rows for r in rings]), _batched([r.positions for r in rings])
    b = rows.shape[0]
    old_pos = positions.flatten().index_select(0, plan.ring_rows).view(b, -1)
    held = (old_pos == plan.ring_positions) & plan.ring_open
    new_rows = codec.encode(kv)
    # a slot not holding its position may never have been written (zero bytes do not decode): read the
    # request's new row there instead, masked out like any slot outside the window. Rows are picked by
    # index_select from the rings and the new rows stacked (uint8 gather and where are ~15x slower on the CPU).
    pick = torch.where(held, plan.ring_rows.view(b, -1), plan.fresh_rows).flatten()
    old_rows = torch.cat([rows.flatten(0, 1), new_rows]).index_select(0, pick).view(b, -1, new_rows.shape[-1])
    win_kv = torch.cat([codec.decode(old_rows), kv[:, None]], dim=1)
    win_mask = torch.cat([held, plan.fresh_open], dim=1)
    for i, ring in enumerate(rings):
        row = new_rows[i : i + 1]
        ring.store(row if ring.log is None else row.clone(), plan.positions[i : i + 1])
    return win_kv, win_mask


def _batched(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(tensors)``, or a view of the one tensor (no copy of a lone request's ring)."""
    return tensors[0][None] if len(tensors) == 1 else torch.stack(tensors)


def _update_global(attn: Attention, x: torch.Tensor, segs: list[Segment], pos: torch.Tensor) -> None:
    """The compressor of a KV-source layer over the batch: each request's tail takes its row, and the groups
    completed in this step become index keys and main-KV entries (computed together, stored per request)."""
    comp, layer, r = attn.compressor, attn.info.layer_id, attn.info.compress_ratio
    kv = comp.wkv(x).float()
    score = comp.wgate(x).float() if r > 1 else None
    done, group_kv, group_score = [], [], []
    for b, seg in enumerate(segs):
        t = int(pos[b])
        if r > 1:
            tail = seg.state.tails[layer]
            if tail.count != t % r:
                raise ValueError(f"compressor tail holds {tail.count} rows but position {t} needs {t % r}")
            if tail.count + 1 < r:
                tail.push(kv[b], score[b])
                continue
            group_kv.append(torch.cat([tail.kv[: tail.count], kv[b : b + 1]]))
            group_score.append(torch.cat([tail.score[: tail.count], score[b : b + 1]]))
            tail.clear()
        done.append(b)
    if not done:
        return
    latent = comp.norm(pool_groups(torch.cat(group_kv), torch.cat(group_score), r) if r > 1 else kv)
    gids = torch.div(pos[done], r, rounding_mode="floor")
    first = gids * r
    keys = attn.codecs.index_key.encode(attn.indexer.keys(latent, first, attn.rope))
    main = attn.codecs.main.encode(attn.compressed_entries(latent, gids))
    for m, b in enumerate(done):
        state = segs[b].state
        if bool(state.main[layer].unheld(gids[m : m + 1])[0]):  # a replay never rewrites held entries
            state.index_keys[layer].write_rows(keys[m : m + 1])
            state.main[layer].write_rows(main[m : m + 1])


def _select(
    attn: Attention, qr: torch.Tensor, x: torch.Tensor, segs: list[Segment], pos: torch.Tensor
) -> None:
    """Index queries for the whole batch; a candidate consumer then selects per request from its own pool
    (`Attention.select`); other layers score each request's stored keys (`StoredKeys`) and take top-k and
    candidate blocks for the whole batch over scores padded with −inf to the longest key list, each segment
    getting its unpadded columns."""
    info, indexer = attn.info, attn.indexer
    q_idx, w = indexer.queries(qr, x, pos, attn.rope, attn.codecs.index_key)
    if info.candidate == "consumer":
        for b, seg in enumerate(segs):
            seg.topk[info.layer_id] = attn.select(q_idx[b : b + 1], w[b : b + 1], seg)
        return
    keys = [StoredKeys.of(seg.state.index_keys[info.kv_src]) for seg in segs]
    lengths = [k.num_entries for k in keys]
    n, r = max(lengths), info.compress_ratio
    limit = torch.cat([visible_entries(pos[b : b + 1], lengths[b], r) for b in range(len(segs))])
    size, top_blocks = attn.candidate_block_size, attn.candidate_topk_blocks
    scores = torch.full((len(segs), n), float("-inf"), device=x.device)
    for b, k in enumerate(keys):
        scores[b, : lengths[b]] = index_scores(q_idx[b : b + 1], w[b : b + 1], k, limit[b : b + 1])[0]
    if info.candidate == "source":
        blocks, ok = select_candidate_blocks(scores, limit, block_size=size, topk_blocks=top_blocks)
        for b, seg in enumerate(segs):
            kb = min(top_blocks, -(-lengths[b] // size))
            seg.candidates = (blocks[b : b + 1, :kb], ok[b : b + 1, :kb])
    idx, valid = select_topk(scores, attn.index_topk)
    for b, seg in enumerate(segs):
        k = min(attn.index_topk, lengths[b])
        seg.topk[info.layer_id] = (idx[b : b + 1, :k], valid[b : b + 1, :k])


def _padded(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-request ``(idx int64 [1, k_b], valid bool [1, k_b])`` → ``[B, max k_b]``, padding 0 / False."""
    width = max(i.shape[1] for i, _ in pairs)
    idx = torch.zeros(len(pairs), width, dtype=torch.int64, device=pairs[0][0].device)
    valid = torch.zeros(len(pairs), width, dtype=torch.bool, device=pairs[0][0].device)
    for b, (i, v) in enumerate(pairs):
        idx[b, : i.shape[1]], valid[b, : v.shape[1]] = i[0], v[0]
    return idx, valid


def _gather_main(attn: Attention, segs: list[Segment]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's selected main-KV entries of ``kv_src``, decoded together: ``(fp32 [B, K, D], valid)``
    (zeros and invalid past a request's own k)."""
    info, codec = attn.info, attn.codecs.main
    picks = [seg.topk[info.idx_src] for seg in segs]
    idx, valid = _padded(picks)
    width = idx.shape[1]
    out = torch.zeros(len(segs) * width, codec.dim, device=idx.device)
    raws = [
        seg.state.main[info.kv_src].raw_at(i[0]) for seg, (i, _) in zip(segs, picks, strict=True) if i.numel()
    ]
    if raws:
        at = torch.cat([b * width + torch.arange(i.shape[1]) for b, (i, _) in enumerate(picks)])
        out[at.to(idx.device)] = codec.decode(torch.cat(raws))
    return out.view(len(segs), width, codec.dim), valid
