"""The slow, obviously-correct reference: every position of a sequence recomputed from scratch, no cache.

`forward_full` runs the same weights and the same math pieces as the cached path (projections, `attend`,
`index_scores`, `select_topk`, candidate blocks) but builds every set directly from the whole sequence:
compressed entries from complete groups, the window as a band mask, visibility as ``j < (t + 1) // r``.
Stored values are replaced by ``codec.roundtrip`` at the points where the cached path stores them, so in
quantised mode it computes what the caches would hold without holding any. No bounded replay: every
row runs through every layer. The cached paths are tested against it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvdiet.model.attention import Attention, attend
from kvdiet.model.hc import hc_collapse, hc_expand, hc_init_streams, hc_initial_pre
from kvdiet.model.index_scores import StoredKeys, index_scores
from kvdiet.model.selection import candidate_mask, select_candidate_blocks, select_topk, visible_entries
from kvdiet.model.transformer import Transformer

__all__ = ["ReferenceTrace", "forward_full"]


class ReferenceTrace:
    """What `forward_full` computed per layer, for tests: ``entries[l]`` (main KV as read back, [N, D]),
    ``keys[l]`` (index keys as read back, [N, d]), ``topk[l]`` (``(idx, valid)`` [T, k])."""

    def __init__(self) -> None:
        self.entries: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.topk: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


@torch.no_grad()
def forward_full(
    model: Transformer, tokens: Sequence[int] | torch.Tensor, trace: ReferenceTrace | None = None
) -> torch.Tensor:
    """Logits fp32 [T, V] of every position of ``tokens`` (positions 0..T−1), without caches.

    Raises:
        ValueError: invalid tokens (as `Transformer.check_tokens` on a fresh request).
    """
    ids = model.check_tokens(tokens)
    cfg, t = model.cfg, ids.numel()
    pos = torch.arange(t)
    trace = trace if trace is not None else ReferenceTrace()
    row_ids = {}
    if model.hasher is not None:
        with_hist = model.hasher.with_history(model.hasher.compress(ids))
        row_ids = {layer: model.hasher.row_ids(layer, with_hist) for layer in model.hasher.layer_ids}
    h = hc_init_streams(model.embed(ids), cfg.hc_mult)
    prev_pre = hc_initial_pre(t, cfg.hc_mult)
    candidates = None
    for block in model.layers:
        layer = block.info.layer_id
        if block.engram is not None:
            h = block.engram(h, row_ids[layer])
        attn_pre, post, comb = block.coefficients(h, "attn")
        x = block.attn_norm(hc_collapse(h, prev_pre))
        out, candidates = _attention(block.attn, x, pos, trace, candidates)
        h = hc_expand(out, h, post, comb)
        h, prev_pre = block.ffn_half(h, attn_pre)
    return model.head(model.norm(hc_collapse(h, prev_pre))).float()


def _attention(
    attn: Attention,
    x: torch.Tensor,
    pos: torch.Tensor,
    trace: ReferenceTrace,
    candidates: tuple[torch.Tensor, torch.Tensor] | None,
):
    info, codecs = attn.info, attn.codecs
    layer, r = info.layer_id, info.compress_ratio
    rot = attn.rope.at(pos)
    qr, q = attn.project_q(x, rot)
    kv = codecs.window.roundtrip(attn.project_window_kv(x, rot))
    if attn.compressor is not None:
        latent, gids = attn.compressor(x, 0, None)
        group_rot = attn.rope.at(gids * r)
        trace.keys[layer] = codecs.index_key.roundtrip(attn.indexer.keys(latent, group_rot))
        trace.entries[layer] = codecs.main.roundtrip(attn.compressed_entries(latent, group_rot))
    if attn.indexer is not None:
        keys = trace.keys[info.kv_src]
        q_idx, w = attn.indexer.queries(qr, x, rot, codecs.index_key)
        visible = visible_entries(pos, keys.shape[0], r)
        scores = index_scores(q_idx, w, StoredKeys.contiguous(keys), visible)
        if info.candidate == "source":
            candidates = select_candidate_blocks(
                scores, visible, block_size=attn.candidate_block_size, topk_blocks=attn.candidate_topk_blocks
            )
        elif info.candidate == "consumer":
            keep = candidate_mask(
                *candidates, num_entries=keys.shape[0], block_size=attn.candidate_block_size
            )
            scores = scores.masked_fill(~keep, float("-inf"))
        trace.topk[layer] = select_topk(scores, attn.index_topk)
    comp = comp_mask = None
    if r:
        idx, comp_mask = trace.topk[info.idx_src]
        comp = trace.entries[info.kv_src][idx]
    mask = attn.window_mask(pos, pos, 0)
    o = attend(q, kv, mask, comp, comp_mask, attn.attn_sink, attn.scale)
    return attn.project_out(o, rot), candidates
