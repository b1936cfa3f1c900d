"""The three fidelity experiments, each against its exact counterpart in the same run.

All runs prefill a prompt in chunks that end at each context length L (and every ``chunk`` tokens), and
compare the next-token logits of the last ``rows`` positions before L (decoder-side replay keeps the
last window of each chunk, so ``rows`` ≤ ``sliding_window``).

1. `cache_precision`: the model with fp32 caches against the same model with FP4 main KV, MXFP4 index keys
   (keys and queries), FP8 window entries — each alone and all three — KL, top-1, max |Δlogit|; and what index
   precision does to selection: top-k overlap with the fp32-cache run, per index-source layer.
2. `csa2_selection` (packed caches, as deployed): Reuse layers — overlap of the borrowed top-k with the
   top-k by this layer's own attention mass over every visible compressed entry; Reindex layers — overlap
   with their KV source's top-k; candidate consumers — recall of the dense top-k (own scores, no candidate
   mask) by the selection made inside the candidate pool.
3. `replay`: decoder-side replay (decoder layers on each chunk's last window) against the full
   decoder; encoder-side replay after a prefix hit at H (rewind to H − window, recompute to L) against a cold
   prefill chunked the same way — KL, top-1, max |Δlogit| of the last row, and greedy continuation agreement.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from kvdiet.fidelity.measures import (
    continuation_agreement,
    kl_divergence,
    max_abs_delta,
    set_overlap,
    top1_agreement,
)
from kvdiet.formats.codec import CacheCodecs
from kvdiet.model.attention import Selection
from kvdiet.model.index_scores import StoredKeys, index_scores
from kvdiet.model.selection import select_topk, visibility_mask, visible_entries
from kvdiet.model.transformer import Transformer

__all__ = [
    "VARIANTS",
    "Point",
    "cache_precision",
    "csa2_selection",
    "prefill_rows",
    "quantised_caches",
    "replay",
]

VARIANTS: dict[str, tuple[str, ...]] = {
    "fp4 main KV": ("main",),
    "mxfp4 index keys": ("index",),
    "fp8 window": ("window",),
    "all three": ("main", "index", "window"),
}
"""Cache-precision variants: which caches are stored packed (the others fp32)."""


@dataclass(frozen=True, slots=True)
class Point:
    """One measured figure, averaged over prompts (and rows). ``value`` is the mean; ``n`` how many rows or
    runs went in. ``hit`` is the prefix-hit length for encoder-side replay, else None."""

    experiment: str
    variant: str
    measure: str
    context: int
    value: float
    n: int
    hit: int | None = None


@contextlib.contextmanager
def quantised_caches(model: Transformer, kinds: Sequence[str]) -> Iterator[None]:
    """Inside the block, new states store the caches in ``kinds`` (``main``, ``index``, ``window``) packed
    and the others fp32 (states created before keep theirs)."""
    unknown = set(kinds) - {"main", "index", "window"}
    if unknown:
        raise ValueError(f"unknown cache kinds {sorted(unknown)}")
    exact = CacheCodecs.for_dims(model.cfg.head_dim, model.cfg.index_head_dim, exact=True)
    packed = CacheCodecs.for_dims(model.cfg.head_dim, model.cfg.index_head_dim)
    codecs = CacheCodecs(
        packed.main if "main" in kinds else exact.main,
        packed.index_key if "index" in kinds else exact.index_key,
        packed.window if "window" in kinds else exact.window,
    )
    saved = model.codecs
    _set_codecs(model, codecs)
    try:
        yield
    finally:
        _set_codecs(model, saved)


def _set_codecs(model: Transformer, codecs: CacheCodecs) -> None:
    model.codecs = codecs
    for block in model.layers:
        block.attn.codecs = codecs


def chunk_ends(contexts: Sequence[int], chunk: int) -> list[int]:
    """Prefill chunk ends: every context length and every ``chunk`` tokens up to the longest."""
    top = max(contexts)
    return sorted(set(contexts) | set(range(chunk, top, chunk)))


def prefill_rows(
    model: Transformer,
    ids: torch.Tensor,
    contexts: Sequence[int],
    *,
    rows: int,
    chunk: int,
    decoder_replay: bool = True,
    state=None,
) -> tuple[dict[int, torch.Tensor], object]:
    """Prefill ``ids`` in chunks ending at each context; returns ``({L: logits fp32 [rows, V]}, state)``."""
    state = model.new_state() if state is None else state
    out: dict[int, torch.Tensor] = {}
    start = state.num_tokens
    for end in chunk_ends(contexts, chunk):
        if end <= start:
            continue
        logits = model.prefill(state, ids[start:end], decoder_replay=decoder_replay, all_logits=True)
        if end in contexts:
            out[end] = logits[-rows:]
        start = end
    return out, state


def _mean(points: dict[tuple, list[torch.Tensor]]) -> dict[tuple, tuple[float, int]]:
    out = {}
    for key, parts in points.items():
        values = torch.cat([p.reshape(-1).double() for p in parts])
        out[key] = (float(values.mean()), int(values.numel()))
    return out


def _logit_measures(exact: torch.Tensor, approx: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "kl": kl_divergence(exact, approx),
        "top1": top1_agreement(exact, approx),
        "max_abs_dlogit": max_abs_delta(exact, approx),
    }


def _selection_recorder(
    positions_of_interest: set[int],
) -> tuple[Callable[[Selection], None], dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]]:
    store: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def observe(sel: Selection) -> None:
        if sel.attn.indexer is None:
            return
        for r, pos in enumerate(sel.seg.positions.tolist()):
            if pos in positions_of_interest:
                store[(sel.attn.info.layer_id, pos)] = (sel.idx[r], sel.valid[r])

    return observe, store


def reached(ids: torch.Tensor, contexts: Sequence[int]) -> list[int]:
    """The contexts (tokens) prompt ``ids`` reaches: those no longer than it. A prompt that reaches none is not
    measured."""
    return [c for c in contexts if c <= ids.numel()]


def _measured(
    prompts: Sequence[torch.Tensor], contexts: Sequence[int], rows: int, done: Callable[[], None]
) -> Iterator[tuple[torch.Tensor, list[int], set[int]]]:
    """Each prompt that reaches a context, with the contexts it reaches and the positions measured before them;
    ``done()`` as the caller asks for the next one (it is through with this one: progress)."""
    for ids in prompts:
        if reach := reached(ids, contexts):
            yield ids, reach, {p for c in reach for p in range(c - rows, c)}
            done()


def cache_precision(
    model: Transformer,
    prompts: Sequence[torch.Tensor],
    contexts: Sequence[int],
    *,
    rows: int,
    chunk: int,
    done: Callable[[], None] = lambda: None,
) -> list[Point]:
    """Experiment 1 (module docstring); ``done()`` after each prompt measured (progress)."""
    acc: dict[tuple, list[torch.Tensor]] = {}
    for ids, reach, wanted in _measured(prompts, contexts, rows, done):
        base_obs, base_sel = _selection_recorder(wanted)
        with quantised_caches(model, ()), model.observe_selection(base_obs):
            base, _ = prefill_rows(model, ids, reach, rows=rows, chunk=chunk)
        for variant, kinds in VARIANTS.items():
            obs, sel = _selection_recorder(wanted)
            with quantised_caches(model, kinds), model.observe_selection(obs):
                got, _ = prefill_rows(model, ids, reach, rows=rows, chunk=chunk)
            for c in reach:
                for measure, values in _logit_measures(base[c], got[c]).items():
                    acc.setdefault((variant, measure, c), []).append(values)
            for (layer, pos), (idx, valid) in sel.items():
                if (layer, pos) in base_sel:
                    b_idx, b_valid = base_sel[(layer, pos)]
                    c = min(c for c in reach if pos < c)
                    ov = set_overlap(idx[None], valid[None], b_idx[None], b_valid[None])
                    acc.setdefault((variant, f"topk_overlap_L{layer}", c), []).append(ov)
    return [
        Point("cache_precision", variant, measure, c, value, n)
        for (variant, measure, c), (value, n) in sorted(
            _mean(acc).items(), key=lambda kv: (kv[0][2], kv[0][0])
        )
    ]


def csa2_selection(
    model: Transformer,
    prompts: Sequence[torch.Tensor],
    contexts: Sequence[int],
    *,
    rows: int,
    chunk: int,
    done: Callable[[], None] = lambda: None,
) -> list[Point]:
    """Experiment 2 (module docstring), with the caches packed as deployed; ``done()`` after each prompt."""
    acc: dict[tuple, list[torch.Tensor]] = {}
    for ids, reach, wanted in _measured(prompts, contexts, rows, done):

        def observe(sel: Selection, reach: list[int] = reach, wanted: set[int] = wanted) -> None:
            keep = [r for r, p in enumerate(sel.seg.positions.tolist()) if p in wanted]
            if not keep:
                return
            rows_ = torch.tensor(keep)
            pos = sel.seg.positions[rows_]
            context = torch.tensor([min(c for c in reach if p < c) for p in pos.tolist()])
            for variant, values in _csa2_measures(sel, rows_, pos).items():
                for c in context.unique().tolist():
                    acc.setdefault((variant, c), []).append(values[context == c])

        with model.observe_selection(observe):
            prefill_rows(model, ids, reach, rows=rows, chunk=chunk)
    out = []
    for (variant, c), (value, n) in sorted(_mean(acc).items(), key=lambda kv: (kv[0][1], kv[0][0])):
        measure = "recall" if variant.startswith("candidate pool") else "topk_overlap"
        out.append(Point("csa2_selection", variant, measure, c, value, n))
    return out


def _csa2_measures(sel: Selection, rows: torch.Tensor, pos: torch.Tensor) -> dict[str, torch.Tensor]:
    attn, info, state = sel.attn, sel.attn.info, sel.seg.state
    k = attn.index_topk
    idx, valid = sel.idx[rows], sel.valid[rows]
    out: dict[str, torch.Tensor] = {}
    if attn.indexer is None:  # Reuse: the borrowed top-k vs this layer's own attention mass
        entries = state.main[info.kv_src].read()
        visible = visibility_mask(pos, entries.shape[0], info.compress_ratio)
        logits = torch.einsum("thd,nd->thn", sel.q[rows], entries) * attn.scale
        mass = torch.softmax(logits.masked_fill(~visible[:, None, :], float("-inf")), dim=-1)
        own_idx, own_valid = select_topk(
            torch.nan_to_num(mass, nan=0.0).sum(1).masked_fill(~visible, float("-inf")), k
        )
        out[f"reuse L{info.layer_id} vs own attention"] = set_overlap(idx, valid, own_idx, own_valid)
        return out
    if not info.owns_index_keys:  # Reindex: own selection vs the KV source's
        src_idx, src_valid = sel.seg.topk[info.kv_src]  # the same rows: published in this segment
        out[f"reindex L{info.layer_id} vs L{info.kv_src}"] = set_overlap(
            idx, valid, src_idx[rows], src_valid[rows]
        )
    if info.candidate == "consumer":  # the candidate pool's recall of the dense top-k
        q_idx, w = attn.indexer.queries(sel.qr[rows], sel.x[rows], attn.rope.at(pos), attn.codecs.index_key)
        keys = StoredKeys.of(state.index_keys[info.kv_src])
        scores = index_scores(q_idx, w, keys, visible_entries(pos, keys.num_entries, info.compress_ratio))
        dense_idx, dense_valid = select_topk(scores, k)
        out[f"candidate pool recall L{info.layer_id}"] = set_overlap(idx, valid, dense_idx, dense_valid)
    return out


def _greedy(model: Transformer, state, first: torch.Tensor, n: int) -> list[int]:
    tokens, token = [], int(first.argmax())
    for _ in range(n):
        tokens.append(token)
        token = int(model.decode([state], [token])[0].argmax())
    return tokens


def replay(
    model: Transformer,
    prompts: Sequence[torch.Tensor],
    contexts: Sequence[int],
    *,
    rows: int,
    chunk: int,
    hits: Sequence[int],
    continuation: int,
    done: Callable[[], None] = lambda: None,
) -> list[Point]:
    """Experiment 3 (module docstring); encoder-side replay at the longest context each prompt reaches;
    ``done()`` after each prompt."""
    window = model.cfg.sliding_window
    acc: dict[tuple, list[torch.Tensor]] = {}
    for ids, reach, _ in _measured(prompts, contexts, rows, done):
        top = max(reach)
        full, full_state = prefill_rows(model, ids, reach, rows=rows, chunk=chunk, decoder_replay=False)
        bounded, bounded_state = prefill_rows(model, ids, reach, rows=rows, chunk=chunk)
        for c in reach:
            for measure, values in _logit_measures(full[c], bounded[c]).items():
                acc.setdefault(("decoder", measure, c, None), []).append(values)
        agree = continuation_agreement(
            _greedy(model, full_state, full[top][-1], continuation),
            _greedy(model, bounded_state, bounded[top][-1], continuation),
        )
        acc.setdefault(("decoder", "continuation", top, None), []).append(torch.tensor([agree]))
        for hit in hits:
            if not window < hit < top:
                continue
            cold, cold_state = prefill_rows(model, ids, [hit, top], rows=1, chunk=top)
            _, state = prefill_rows(model, ids, [hit], rows=1, chunk=top)
            model.rewind(state, hit - window, ids)
            warm = model.prefill(state, ids[hit - window : top], all_logits=True)[-1:]
            for measure, values in _logit_measures(cold[top], warm).items():
                acc.setdefault(("encoder", measure, top, hit), []).append(values)
            agree = continuation_agreement(
                _greedy(model, cold_state, cold[top][-1], continuation),
                _greedy(model, state, warm[-1], continuation),
            )
            acc.setdefault(("encoder", "continuation", top, hit), []).append(torch.tensor([agree]))
    return [
        Point("replay", f"{side}-side", measure, c, value, n, hit)
        for (side, measure, c, hit), (value, n) in sorted(
            _mean(acc).items(), key=lambda kv: (kv[0][0], kv[0][3] or 0, kv[0][2], kv[0][1])
        )
    ]


def as_dicts(points: Sequence[Point]) -> list[dict]:
    """Points as JSON-ready dicts."""
    return [dataclasses.asdict(p) for p in points]
