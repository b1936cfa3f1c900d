"""A decode step's index selection over the whole batch: each index layer's queries, scores on the stored MXFP4
keys, top-k and candidate blocks, published in the step's `kvdiet.model.decode_step.DecodePlan`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvdiet.formats import native
from kvdiet.model.attention import Attention, Segment
from kvdiet.model.index_scores import StoredKeys, index_scores_at, index_scores_each, index_scores_runs
from kvdiet.model.layers import Rotation
from kvdiet.model.selection import candidate_entries, select_candidate_blocks, select_topk, select_topk_at

if TYPE_CHECKING:
    from kvdiet.model.decode_step import DecodePlan

__all__ = ["select_step", "visible_keys"]

_SCAN_BLOCK = 8
"""Entries per block of the block maxima a dense index layer's scores come with (for `select_topk`)."""
_LONG_ROW = 8 * 16_384
"""The fewest entries a row has for its block maxima to be taken: the compiled selection reads them from 16,384
blocks on (``topk_kernels.cpp``: four times its sample of 4,096)."""


def select_step(
    attn: Attention, qr: torch.Tensor, x: torch.Tensor, segs: list[Segment], plan: DecodePlan, rot: Rotation
) -> None:
    """An index layer's queries, scores, top-k and candidate blocks for a decode step's whole batch, published in
    ``plan`` (``topk``, ``candidates``; `kvdiet.model.decode_step.DecodePlan`).

    Scores are read from each request's stored keys (`StoredKeys`). A candidate consumer scores the entries of
    the candidate source's kept blocks: in one call when several requests share a pool (`BatchTables`), else
    one call per request. Other layers score every entry with no per-entry ids (no [B, N] temporaries: N is 1M
    at 1M tokens and ratio 1), padded with −inf to the longest key list: in one call when the requests share a
    pool (each its own run of it), else one call per request; on the CPU the candidate source's scores, and any
    row of ``_LONG_ROW`` entries or more, come with their block maxima (the compiled kernel's, taken as it
    scores), which its candidate blocks and the top-k read instead of another pass over the scores.
    """
    info = attn.info
    q_idx, w = attn.indexer.queries(qr, x, rot, attn.codecs.index_key, pending=plan.pending)
    keys, limit, n, host_limit = visible_keys(plan, segs, info.kv_src, info.compress_ratio)
    tables, pending = plan.tables, plan.pending
    if info.candidate != "consumer":
        # the scores' block maxima, taken as they are scored: the candidate source's blocks, and a long row's
        # top-k candidates (`select_topk`'s maxima) without another pass over its scores
        block = attn.candidate_block_size if info.candidate == "source" else _SCAN_BLOCK
        # (on the CPU; a long row only where the compiled top-k reads them: the pure-torch one does not)
        wanted = info.candidate == "source" or (n >= _LONG_ROW and native.fp4_kernels() is not None)
        maxima = (torch.empty(len(segs), -(-n // block)), block) if q_idx.is_cpu and wanted else None
        if tables.shared is not None and len(segs) > 1:  # one call: each request scores its run of the pool
            off = tables.offsets(info.kv_src)
            scores = index_scores_runs(
                q_idx, w, tables.keys(info.kv_src, "index"), off, limit, n, pending=pending, maxima=maxima
            )
        else:
            scores = index_scores_each(
                q_idx, w, keys, None, limit, host_limit=host_limit, pending=pending, maxima=maxima
            )
        if info.candidate == "source":
            plan.candidates = select_candidate_blocks(
                scores,
                limit,
                block_size=block,
                topk_blocks=attn.candidate_topk_blocks,
                block_scores=None if maxima is None else maxima[0],
            )
        plan.topk[info.layer_id] = select_topk(scores, attn.index_topk, maxima=maxima)
        return
    if plan.candidates is None:
        raise RuntimeError(f"layer {info.layer_id} consumes candidates but none were published")
    size = attn.candidate_block_size
    entries = plan.candidate_ids.get(size)
    if entries is None:
        entries = plan.candidate_ids[size] = candidate_entries(*plan.candidates, block_size=size)
    if tables.shared is not None and len(segs) > 1:
        off = tables.offsets(info.kv_src)
        shifted = torch.where(entries >= 0, entries + off[:, None], -1)  # an empty slot (-1) stays empty
        scores = index_scores_at(
            q_idx, w, tables.keys(info.kv_src, "index"), shifted, limit + off, pending=pending
        )
    else:
        scores = index_scores_each(q_idx, w, keys, entries, limit, host_limit=host_limit, pending=pending)
    plan.topk[info.layer_id] = select_topk_at(scores, entries, attn.index_topk, n)


def visible_keys(
    plan: DecodePlan, segs: list[Segment], kv_src: int, ratio: int
) -> tuple[list[StoredKeys], torch.Tensor, int, list[int]]:
    """``plan.visible[kv_src]``, taken on the first call of the step: each request's index keys of ``kv_src``
    (none when the requests share a pool and are scored in one call over it, `BatchTables.keys`), how many it
    sees (`visible_entries`: a prefix of its own entries, ``min((t + 1) // ratio, held)`` with t its
    ``num_tokens``, the new row's position; int64 [B]), the most entries any request holds, and the counts as
    host ints (computed there, copied to the device: no host read)."""
    got = plan.visible.get(kv_src)
    if got is None:
        stores = [seg.state.index_keys[kv_src] for seg in segs]
        lengths = [len(s) for s in stores]
        host = [min((seg.state.num_tokens + 1) // ratio, n) for seg, n in zip(segs, lengths, strict=True)]
        limit = torch.tensor(host, device=plan.positions.device)
        each = plan.tables.shared is None or len(segs) == 1
        stored = [StoredKeys.of(s) for s in stores] if each else []
        got = plan.visible[kv_src] = (stored, limit, max(lengths), host)
    return got
