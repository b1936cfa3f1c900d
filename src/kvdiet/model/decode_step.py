"""One V4.1 decode step for a batch of requests: each layer's attention in one set of tensor ops.

`Attention.forward` runs one request's rows at a time; in a decode step every request brings one row, so
the batch is a loop of B tiny calls per layer. Here the projections, the window read, the index queries,
scores, top-k, the gather of selected entries and the softmax run once over the batch ([B, …] tensors, ragged
lengths padded and masked). Per step, `DecodePlan` computes the positions, every layer's window slots and mask,
and the RoPE rotations at the step's positions (one per table, `Rotation`) once for every layer; each layer
gathers its window straight from the requests' rings (`WindowRings`, no copy of the rings), stages its new
window entries, and the plan stores them once per request at the end; the top-k and candidate blocks stay
batched, and each (KV source, top-k source) pair's gathered entries are kept for the Reuse layers that read the
same ones. Layers that score every index key score each request's keys in place with no per-entry ids;
requests sharing a pool (an engine's) score a candidate pool and gather their selected entries in one call over
their block tables end to end (`BatchTables`), requests on private pools one call each. Only the compressor
tails are touched request by request; the new global entries are stored in one copy per kind.

Same results as the per-request path up to fp32 reassociation (batched matmuls): the same entries are
read and written, every selection is the same function of the same scores, padding is masked (−inf).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from kvdiet.formats.scales import PendingCheck, run_checks
from kvdiet.layer_plan import LayerPlan
from kvdiet.model.attention import Attention, Segment, Selection
from kvdiet.model.batch_tables import BatchTables
from kvdiet.model.compressor import pool_groups
from kvdiet.model.compressor_tail import CompressorTail
from kvdiet.model.decode_attend import decode_attend
from kvdiet.model.decode_select import select_step
from kvdiet.model.fused_rows import project_out_rows, project_rows
from kvdiet.model.index_scores import StoredKeys
from kvdiet.model.layers import Rope, Rotation, as_dtype
from kvdiet.model.member import member
from kvdiet.model.row_tables import RowTables
from kvdiet.model.state import PagedEntries, RequestState, WindowRings

__all__ = ["DecodePlan", "attend_inputs", "attend_out", "decode_attention"]


@dataclass(slots=True)
class DecodePlan:
    """What every layer of one decode step shares.

    Each layer reads its window straight from every request's rings (`WindowRings`, one gather per request),
    with its new entries as the last key, and stages their bytes in ``fresh``; `store_windows` writes each
    request's new entries of every layer into its rings at the end. The value checks of the stored bytes the step
    reads (window rows, index keys scored, main-KV entries gathered) and of the values it encodes (window
    entries, index queries and keys, main KV) wait in ``pending`` and are read together (`check_pending`: one
    host read, a device wait on a GPU) before a compressor's tails change, before it writes its entries to the
    pools, before a selection observer is called, and before the rings are written. Between those points the
    layers only compute, so a failing check raises its own error, the first in layer order, with the state as
    when it was checked at once.

    Attributes:
        positions: int64 [B], the new row's position per request.
        rings: each request's window rings, read in place (not copied).
        layer_rings: per layer l, the B rings' rows of layer l, [W, width] views in the window codec's dtype
            (``rings[b].rows[l]``, taken once per step).
        fresh: per layer l, uint8 [B, width] (the window codec's dtype and width), its new entries, set by the
            layer (None until then).
        window_slots: int64 [B, W−1], the ring slots of request b's older window positions ``t−W+1 … t−1``
            (``position % W``; the same in every layer).
        window_held: per layer l, bool [B, W−1], whether its ring slot holds that position and it is readable (≥
            0 and ≥ the request's window floor); None when every slot of every layer is (a slot not held is read
            as the layer's new entry instead, masked out: a slot never written may hold bytes that do not
            decode).
        window_mask: per layer l, bool [B, W], which of its window keys request b reads (``window_held``, then its
            new entry, always).
        tables: the batch's block tables (`BatchTables`).
        rows: the step's `RowTables`: each RoPE table's ``Rope.at(positions)``, made by its first use.
        groups: per compressor ratio r > 1, `closing_groups`' requests, their groups' first positions int64 [M]
            and the rotations there (`RowTables`), made by the ratio's first layer.
        topk: ``{index source: (idx int64 [B, k], valid bool [B, k])}`` published during the step (request b's
            own top-k is its first ``min(index_topk, its entries)`` columns; the rest are invalid).
        candidates: the candidate source's kept blocks ``(block ids int64 [B, Kb], valid bool [B, Kb])``.
        gathered: ``{(kv_src, idx_src): (entries [B, K, D], valid bool [B, K])}`` filled during the step (fp32, or
            bf16 from the compiled gather: `kvdiet.model.batch_tables.BatchTables.gather`); a pair no later layer
            reads (``last_reads``) gives up its entries' buffer to the next pair gathered.
        last_reads: ``{(kv_src, idx_src): the last layer reading that pair's gathered entries}`` (`last_reads` of
            the model's layer plan; empty: no buffer is passed on).
        visible: ``{kv_src: (each request's `StoredKeys`, limit int64 [B], most entries, limit as host ints)}``:
            the index keys the layers reading ``kv_src`` score and how many each request sees (``min((t+1) //
            ratio, held)``), taken by the first such layer (after ``kv_src`` itself wrote its new entries: no
            later layer writes them).
        candidate_ids: ``{block_size: entries int64 [B, Kb·block_size]}``, `candidate_entries` of ``candidates``.
        pending: the value checks not read yet (`PendingCheck`, in the order the step made them).
        window_keys: fp32 [B, W, D] (CPU, no autograd; None until first asked: `key_buffer`), where each layer's
            fused read writes its keys (`_window`'s or `attn_head`'s), over the layer's before: one buffer a step,
            still in cache from the layer before. A layer's keys are read by its own attention only, before the next
            layer's read. With the gathered pairs' buffers passed on, paired against fresh tensors: a v4.1-mini step
            0.35–0.79 ms faster at 4K (18 and 22 of 24 rounds), 0.31 ms at 1M (13 of 16); neither alone showed above
            the noise. Under autograd (which may save a layer's keys or entries for backward) neither is passed on.
        prepared: ``{layer: (rotation, window-read args) or None}`` of a checked step (`decode_layer.prepare_step`).
    """

    positions: torch.Tensor
    rings: list[WindowRings]
    layer_rings: list[list[torch.Tensor]]
    fresh: list[torch.Tensor | None]
    window_slots: torch.Tensor
    window_held: tuple[torch.Tensor, ...] | None
    window_mask: tuple[torch.Tensor, ...]
    tables: BatchTables
    rows: RowTables = field(default_factory=RowTables)
    groups: dict[int, tuple[list[int], torch.Tensor, RowTables]] = field(default_factory=dict)
    topk: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    candidates: tuple[torch.Tensor, torch.Tensor] | None = None
    gathered: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    visible: dict[int, tuple[list[StoredKeys], torch.Tensor, int, list[int]]] = field(default_factory=dict)
    candidate_ids: dict[int, torch.Tensor] = field(default_factory=dict)
    pending: list[PendingCheck] = field(default_factory=list)
    window_keys: torch.Tensor | None = None
    last_reads: dict[tuple[int | None, int | None], int] = field(default_factory=dict)
    prepared: dict[int, tuple[Rotation, tuple] | None] = field(default_factory=dict)

    @classmethod
    def for_segments(cls, segs: list[Segment], layer_plan: LayerPlan | None = None) -> DecodePlan:
        """The plan of segments holding one row each; their states' rings must be `WindowRings` of one shape, so
        every window slot (``position % W``) lies in its ring (`_window` does not check them on the device).
        ``layer_plan``: the model's, whose `last_reads` let a gathered pair's buffer serve the next pair.

        Raises:
            TypeError: a state's rings are not `WindowRings`.
            ValueError: a request's rings are not [layers, W, width] as the first request's, naming it.
        """
        rings = [_rings(s.state) for s in segs]
        layers, window, _ = shape = rings[0].rows.shape
        for b, r in enumerate(rings):  # host ints: the slots' range check, free
            if r.rows.shape != shape or len(r.layer_rows) != layers:
                raise ValueError(
                    f"request {b}'s window rings are {list(r.rows.shape)} in {len(r.layer_rows)} layer views, "
                    f"request 0's {list(shape)}"
                )
        b, dev = len(segs), rings[0].rows.device
        layer_rings = [list(rows) for rows in zip(*(r.layer_rows for r in rings), strict=True)]
        pos = torch.cat([s.positions for s in segs])
        older = pos[:, None] - (window - 1) + torch.arange(window - 1, device=dev)  # [B, W−1]
        floors, slots = torch.tensor([s.window_floor for s in segs], device=dev), older % window
        ring_positions = torch.stack([r.positions for r in rings], dim=1)  # [L, B, W]
        held = ring_positions.gather(2, slots.expand(layers, b, -1)) == older
        held &= (older >= 0) & (older >= floors[:, None])
        window_mask = torch.cat([held, torch.ones(layers, b, 1, dtype=torch.bool, device=dev)], dim=2)
        held_by_layer = None if held.all() else held.unbind(0)
        fresh: list[torch.Tensor | None] = [None] * layers
        plan = cls(
            pos, rings, layer_rings, fresh, slots, held_by_layer, window_mask.unbind(0), BatchTables.of(segs)
        )
        if layer_plan is not None:
            plan.last_reads = last_reads(layer_plan)
        return plan

    def key_buffer(self, dim: int) -> torch.Tensor:
        """``window_keys``, made fp32 [B, W, ``dim``] on the CPU at its first use this step (every layer's window keys
        have the model's head dim)."""
        if self.window_keys is None:
            b, n = self.window_slots.shape
            self.window_keys = torch.empty(b, n + 1, dim, dtype=torch.float32)
        return self.window_keys

    def rotation(self, rope: Rope) -> Rotation:
        """``rope.at(positions)``, computed once per step for the layers sharing ``rope``'s table (`RowTables`)."""
        return self.rows.rotation(rope, self.positions)

    def closing_groups(self, rope: Rope, r: int, segs: list[Segment]) -> tuple[list[int], Rotation | None]:
        """The requests (increasing) whose compressor group of r rows closes with this step's row (``t % r == r −
        1``, t its state's ``num_tokens``; all at r = 1) and ``rope.at`` their groups' first positions ``t − r +
        1`` (None when there are none), once per step for the layers of that ratio and RoPE table, from host
        ints (no division on the device)."""
        if r == 1:
            return list(range(len(segs))), self.rotation(rope)
        got = self.groups.get(r)
        if got is None:
            steps = [seg.state.num_tokens for seg in segs]
            done = [b for b, t in enumerate(steps) if t % r == r - 1]
            firsts = torch.tensor([steps[b] - r + 1 for b in done], device=self.positions.device)
            got = self.groups[r] = (done, firsts, RowTables())
        done, firsts, rows = got
        return done, rows.rotation(rope, firsts) if done else None

    def check_pending(self) -> None:
        """Read the ``pending`` checks (one host read, none when there are none) and clear them.

        Raises:
            ValueError: the first failed check's error, the one its immediate check would raise: a non-finite
                new window key, index query or compressor entry (`Codec.read_window`, `Indexer.queries`,
                ``Codec.encode``), a stored scale byte outside the written range in a held ring row, a scored
                index key or a gathered main-KV entry (``Codec.decode``, `index_scores_each`), naming it.
        """
        checks, self.pending = self.pending, []
        run_checks(checks)

    def attend(self, attn: Attention, x: torch.Tensor, segs: list[Segment]) -> torch.Tensor:
        """`decode_attention` of this step (what `Attention.forward` calls when given the plan)."""
        return decode_attention(attn, x, segs, self)

    def store_windows(self, segs: list[Segment]) -> None:
        """Write each request's new window entries of every layer into its rings (after the last layer, before
        the states' ``num_tokens`` move on).

        Raises:
            RuntimeError: a layer staged no entries (before any ring is written).
            ValueError: as `check_pending` (before any ring is written).
        """
        if any(f is None for f in self.fresh):
            raise RuntimeError("store_windows before every layer staged its window entries")
        self.check_pending()
        WindowRings.store_steps(self.rings, torch.stack(self.fresh), [seg.state.num_tokens for seg in segs])


def _rings(state: RequestState) -> WindowRings:
    if not isinstance(state.windows, WindowRings):
        raise TypeError(
            "a batched decode step needs the state's rings as WindowRings (Transformer.new_state)"
        )
    return state.windows


def decode_attention(attn: Attention, x: torch.Tensor, segs: list[Segment], plan: DecodePlan) -> torch.Tensor:
    """`Attention.forward` of one row per request: ``x`` fp32 [B, hidden] → fp32 [B, hidden].

    Writes each request's global entries and window entry as `Attention.forward` does and selects the same
    top-k (and candidate blocks), published in the plan (in each segment too while a selection observer is
    installed).
    """
    rot = plan.rotation(attn.rope)
    mods = attn._modules  # its own dict: nn.Module's attribute fallback costs a microsecond a lookup
    # the projections in one compiled call each where they fit (the same bits), else the modules
    qr, q = project_rows(
        x, mods["wq_a"], mods["q_norm"], mods["wq_b"], attn.n_heads, attn.head_dim, rot
    ) or attn.project_q(x, rot)
    kv = project_rows(x, mods["wkv"], mods["kv_norm"], None, 1, attn.head_dim, rot)
    kv = attn.project_window_kv(x, rot) if kv is None else kv[1]
    return attend_out(attn, q, *attend_inputs(attn, x, qr, q, kv, segs, plan, rot), rot)


def attend_inputs(
    attn: Attention,
    x: torch.Tensor,
    qr: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    segs: list[Segment],
    plan: DecodePlan,
    rot: Rotation,
    read: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """What a decode step's attention reads from the caches, after its projections (``x`` fp32 [B, hidden], the
    queries' ``qr`` [B, q_lora] and ``q`` [B, H, D], the window entries ``kv`` [B, D], normed and rotated by the
    step's ``rot``, `DecodePlan.rotation` of the layer's RoPE): a
    KV-source layer's new global entries written (`_update_global`), the window keys and mask (`_window`), an
    index layer's top-k selected, and the selected main-KV entries gathered once per (KV source, index source):
    ``(win_kv fp32 [B, W, D], win_mask bool [B, W], comp [B, K, D] | None, comp_mask bool [B, K] | None)``,
    ``comp`` fp32 or bf16 (`BatchTables.gather`: the same values). ``read``: the layer's window read already made
    with its projections (`kvdiet.model.decode_layer`'s fused read: ``(keys, entries)`` as `_window`'s read gives
    them, on a layer without a compressor), which the plan stages as `_window` does.

    Raises:
        ValueError: as `_update_global` and `DecodePlan.check_pending`.
    """
    info, mods = attn.info, attn._modules
    if mods.get("compressor") is not None:
        _update_global(attn, x, segs, plan)
    if read is None:
        win_kv, win_mask = _window(attn, plan, kv)
    else:
        (win_kv, plan.fresh[info.layer_id]), win_mask = read, plan.window_mask[info.layer_id]
    if mods.get("indexer") is not None:
        select_step(attn, qr, x, segs, plan, rot)
    if attn.selection_observer is not None and info.compress_ratio:
        plan.check_pending()  # the observer sees the top-k only of checked values
        idx, valid = plan.topk[info.idx_src]
        for b, seg in enumerate(segs):
            k = min(attn.index_topk, len(seg.state.main[info.kv_src]))
            seg.topk[info.idx_src] = (idx[b : b + 1, :k], valid[b : b + 1, :k])
            attn.selection_observer(
                Selection(attn, seg, x[b : b + 1], qr[b : b + 1], q[b : b + 1], *seg.topk[info.idx_src])
            )
    if not info.compress_ratio:
        return win_kv, win_mask, None, None
    key = (info.kv_src, info.idx_src)
    if key not in plan.gathered:
        plan.gathered[key] = _gather_main(attn, segs, plan)
    return win_kv, win_mask, *plan.gathered[key]


def attend_out(
    attn: Attention,
    q: torch.Tensor,
    win_kv: torch.Tensor,
    win_mask: torch.Tensor,
    comp: torch.Tensor | None,
    comp_mask: torch.Tensor | None,
    rot: Rotation,
) -> torch.Tensor:
    """The attention over the keys `attend_inputs` read (`decode_attend`), then the output projection (one compiled
    call where it fits, else `Attention.project_out`): fp32 [B, hidden].

    Raises:
        ValueError: inputs without `decode_attend`'s shapes.
    """
    mods = attn._modules
    o = decode_attend(q, win_kv, win_mask, comp, comp_mask, member(attn, "attn_sink"), attn.scale)
    out = project_out_rows(o, rot, mods["wo_a"], mods["wo_b"], attn.n_groups)
    return attn.project_out(o, rot) if out is None else out


def _window(attn: Attention, plan: DecodePlan, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Window keys fp32 [B, W, D] in position order and their mask bool [B, W]: the ring's older ones, then the
    new entries ``kv`` fp32 [B, D] (`Attention.project_window_kv`) as stored values, ``codec.roundtrip(kv)``; a
    fused read writes them into ``plan.window_keys`` (valid until the next layer's read).

    `Codec.read_window` reads each request's ring straight from its `WindowRings` (a slot not held reads the new
    entry, masked out) and gives the entries staged for the rings (`DecodePlan.store_windows`),
    ``encode(roundtrip(kv))``, as `Attention.forward` stores them. The slots lie in the rings
    (`DecodePlan.for_segments`); the value checks wait in ``plan.pending``.
    """
    layer = attn.info.layer_id
    held = None if plan.window_held is None else plan.window_held[layer]
    out = (
        plan.key_buffer(kv.shape[-1]) if kv.is_cpu and not torch.is_grad_enabled() else None
    )  # autograd may save them
    win_kv, plan.fresh[layer] = attn.codecs.window.read_window(
        kv, plan.layer_rings[layer], plan.window_slots, held, pending=plan.pending, out=out
    )
    return win_kv, plan.window_mask[layer]


def _update_global(attn: Attention, x: torch.Tensor, segs: list[Segment], plan: DecodePlan) -> None:
    """The compressor of a KV-source layer over the batch: each request's tail takes its row, and the groups
    completed in this step become index keys and main-KV entries (computed together, stored per request). The
    earlier checks are read first (`DecodePlan.check_pending`: no tail changes before them); the encodes' checks
    join the step's ``pending`` ones, read once before the entries are written.

    Raises:
        ValueError: as `DecodePlan.check_pending`, or a tail does not end at its request's position, or a new
            entry would leave a gap.
    """
    plan.check_pending()
    comp, layer, r = attn.compressor, attn.info.layer_id, attn.info.compress_ratio
    kv = as_dtype(comp.wkv(x), torch.float32)  # ``.float()`` without its dispatch when it is fp32 already
    done, rot = plan.closing_groups(attn.rope, r, segs)  # rot: at each closing group's first position
    if r > 1:
        score = as_dtype(comp.wgate(x), torch.float32)
        tails = [seg.state.tails[layer] for seg in segs]
        for seg, tail in zip(segs, tails, strict=True):
            t = seg.state.num_tokens  # the new row's position
            if tail.count != t % r:
                raise ValueError(f"compressor tail holds {tail.count} rows but position {t} needs {t % r}")
        if len(done) < len(segs):  # the open groups take their rows (their tails hold t % r < r − 1 rows)
            rest = [b for b in range(len(segs)) if b not in done]
            CompressorTail.push_each([tails[b] for b in rest], _rows(kv, rest), _rows(score, rest))
        if not done:
            return
        group_kv, group_score = CompressorTail.close_each(
            [tails[b] for b in done], _rows(kv, done), _rows(score, done)
        )
        kv = pool_groups(group_kv, group_score, r)
    latent, codecs = comp.norm(kv), attn.codecs
    keys = codecs.index_key.encode_deferred(attn.indexer.keys(latent, rot, decode_step=True), plan.pending)
    main = codecs.main.encode_deferred(attn.compressed_entries(latent, rot), plan.pending)
    plan.check_pending()  # before any entry is written
    # a replay never rewrites held entries; the new ones go in one copy per kind
    new = [m for m, b in enumerate(done) if segs[b].state.main[layer].is_next(segs[b].state.num_tokens // r)]
    states = [segs[done[m]].state for m in new]
    if len(new) < len(done):
        keys, main = keys[new], main[new]
    PagedEntries.write_each([s.index_keys[layer] for s in states], keys)
    PagedEntries.write_each([s.main[layer] for s in states], main)


@functools.cache
def last_reads(layer_plan: LayerPlan) -> dict[tuple[int | None, int | None], int]:
    """``{(kv_src, idx_src): the last layer that attends those gathered entries}`` over the layers of
    ``layer_plan`` with compressed entries (`attend_inputs`' pairs), once per plan."""
    return {(info.kv_src, info.idx_src): info.layer_id for info in layer_plan.layers if info.compress_ratio}


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``t[rows]`` of increasing ``rows``: ``t`` itself when they are all of its rows."""
    return t if len(rows) == t.shape[0] else t[rows]


def _gather_main(attn: Attention, segs: list[Segment], plan: DecodePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's selected main-KV entries of ``kv_src``, decoded together (`BatchTables.gather`): ``(fp32 or
    bf16 [B, K, D], valid)`` (zeros past a request's own k, where the top-k is invalid); the stored bytes' check joins
    the step's pending ones (run before any write)."""
    info = attn.info
    idx, valid = plan.topk[info.idx_src]
    # request b's own top-k: its first ks[b] columns
    ks = [min(attn.index_topk, len(seg.state.main[info.kv_src])) for seg in segs]
    spare = None  # the entries of a pair no later layer reads: their buffer, still in cache, takes these
    done = [p for p, last in plan.last_reads.items() if last < info.layer_id and p in plan.gathered]
    for pair in done if not torch.is_grad_enabled() else ():  # autograd may have saved them
        spare = plan.gathered.pop(pair)[0]
    return plan.tables.gather(info.kv_src, idx, ks, attn.codecs.main, plan.pending, spare), valid
