"""Indexer scores read straight from the stored index keys: ``Σ_h relu(q_h · k_j) · w_h`` (v41-spec §4).

Keys are scored where the cache holds them (`StoredKeys`: packed MXFP4 entries, or fp32 rows in exact mode,
in the pages of the device pool), never decoded as a whole: the compiled kernel (``formats/index_kernels.cpp``,
``index_scores``) decodes 16 entries at a time into its own scratch, value-major (one 16-float vector holds a
value of each of the 16 keys), and scores them against every query. On a CPU with AVX-512 VNNI, an MXFP4 query
(what `Indexer.queries` returns) against packed keys is scored from int8 products instead: each block's dot is an
exact integer times a power of two, and where the scales prove that every partial sum of the fp32 order below is
exact (checked per entry and head from the scale bytes), that order's result is the exact dot: the same bits (an
exact zero takes that order's sign from a scalar pass over its products). Entries the check declines, queries that
are not MXFP4 or have a head of zeros, and threads under flush-to-zero keep the fp32 order. With AMX-INT8 (d = 128)
a decode call takes those integers as tile products (``KVDIET_INDEX_AMX=0``: off).
`index_scores` scores every visible entry (KV-source and candidate-source layers); `index_scores_at` only
the entries each query names (a candidate consumer's pool: 2,048 blocks × 8 of 1M entries on V4.1).

Every fp32 step has a fixed order, so a (query, entry) score is the same number whichever other entries
are scored with it, on either path, from packed or decoded keys (an MXFP4 value decodes exactly):

- ``q_h · k_j`` in 8 lanes: lane l sums ``q[i]·k[i]`` for i = l, l+8, … in increasing i (each product
  rounded, then added; no fused multiply-add); the lanes fold as (l, l+4), then (l, l+2), then (0, 1).
- ``relu(x) = 0 if x < 0 else x`` (NaN kept: selection treats it as −inf); heads summed in order from head 0's.

The pure-torch path (``KVDIET_NATIVE_KERNELS=0``, non-CPU tensors, or a failed build) computes the same
order with whole-tensor ops and gives the same bits (a NaN score at the same place, its sign bit not always the
same). Entries a query may not see score −inf.

A decode step passes ``pending`` (a list of `PendingCheck`): the pure-torch path then reads no stored scale byte's
check on the host (it is appended there, the byte read clamped into range meanwhile: finite scores), and a caller
that knows each query's visible entries on the host passes them (``host_limit``) so that none is read either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvdiet.formats import native
from kvdiet.formats.mxfp4 import decode_index_key
from kvdiet.formats.scales import PendingCheck, run_checks
from kvdiet.model.selection import block_max

if TYPE_CHECKING:
    from kvdiet.model.state import PagedEntries

__all__ = ["StoredKeys", "index_scores", "index_scores_at", "index_scores_each", "index_scores_runs"]

LANES = 8
"""Partial sums of one dot product (the kernel's lanes per key; its 16-float vectors hold one lane of 16 keys)."""
# Elements of the pure-torch path's [rows, heads, entries, dim] product per step (64 MiB as fp32).
_TORCH_BUDGET = 1 << 24
_TILE = 64  # entries of the compiled kernel's tasks (kTile): blocks of maxima it takes divide it


@dataclass(frozen=True, slots=True)
class StoredKeys:
    """Index keys where a cache stores them: entry j is row ``table[j // per_block] · per_block + j % per_block``.

    Attributes:
        rows: uint8 [R, 17·d/32] packed MXFP4 entries (`kvdiet.formats.mxfp4`) or fp32 [R, d] (exact mode);
            unit element stride.
        table: int64 [B] block ids (a request's block table), on the device of ``rows``.
        per_block: entries per block.
        num_entries: N, the entries held.
    """

    rows: torch.Tensor
    table: torch.Tensor
    per_block: int
    num_entries: int

    @classmethod
    def contiguous(cls, rows: torch.Tensor) -> StoredKeys:
        """Keys whose entry j is ``rows[j]`` (rows uint8 [N, 17·d/32] or fp32 [N, d])."""
        table = torch.zeros(1, dtype=torch.int64, device=rows.device)
        return cls(rows, table, max(1, rows.shape[0]), rows.shape[0])

    @classmethod
    def of(cls, store: PagedEntries) -> StoredKeys:
        """The index keys of one request and KV-source layer, in place in the device pool (no copy)."""
        rows = store.table.pool.rows(store.layer, store.kind)
        return cls(rows, store.table.tensor().to(rows.device), store.per_block, len(store))

    def decoded(self, ids: torch.Tensor, *, pending: list[PendingCheck] | None = None) -> torch.Tensor:
        """fp32 [M, d] values of entries ``ids`` int64 [M] (each in [0, N)); ``pending``: as
        ``mxfp4.decode_index_key``'s (the scale-byte check appended, not read).

        Raises:
            ValueError: a packed entry holds a scale byte outside 1..252 (``pending`` None).
        """
        rows = self.rows[self.table[ids // self.per_block] * self.per_block + ids % self.per_block]
        return decode_index_key(rows, pending=pending) if rows.dtype == torch.uint8 else rows.float()


def index_scores(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: StoredKeys,
    limit: torch.Tensor,
    *,
    host_limit: Sequence[int] | None = None,
    pending: list[PendingCheck] | None = None,
) -> torch.Tensor:
    """Scores of every entry: fp32 [Q, N], −inf at entries ``j ≥ limit[t]``.

    Args:
        q: fp32 [Q, H, d] index queries (d a multiple of 32, at most 1024).
        w: fp32 [Q, H] head weights (already scaled).
        keys: the stored keys (N entries).
        limit: int64 [Q] entries visible to each query (a prefix; `kvdiet.model.selection.visible_entries`).
        host_limit: None, or ``limit``'s Q values as host ints (the caller's own, equal to them): the pure-torch
            path takes the entries to score from them instead of reading ``limit`` (a host read).
        pending: None checks the visible packed entries' scale bytes now; a list gets that check appended
            (`PendingCheck`, no host read on the pure-torch path) and a failing byte reads clamped into 1..252
            meanwhile. The compiled kernel, which checks as it scores, runs ``pending``'s earlier checks
            (`run_checks`, their error first) and then raises its own.
    Raises:
        ValueError: a visible packed entry holds a scale byte outside 1..252 (see ``pending``); keys of another
            head dim than q (`StoredKeys` rows neither uint8 [R, 17·d/32] nor floating-point [R, d]); w not
            [Q, H] or limit not [Q].
    """
    _check_inputs(q, w, limit, [keys])
    n = keys.num_entries
    limit = limit.clamp(0, n)
    out = _native(q, w, keys, limit, None, n, pending=pending)
    if out is not None:
        return out
    qn, h, d = q.shape
    if host_limit is not None and len(host_limit) != qn:  # host ints: free to check
        raise ValueError(f"index scores: host_limit holds {len(host_limit)} values for {qn} queries")
    out = torch.full((qn, n), float("-inf"), device=q.device)
    # the entries any query sees: from the caller's host ints where given (no host read)
    reach = (
        min(max(max(host_limit), 0), n) if host_limit is not None and qn else int(limit.max()) if qn else 0
    )
    cols = max(1, min(reach, _TORCH_BUDGET // (h * d)))
    for c0 in range(0, reach, cols):
        c1 = min(reach, c0 + cols)
        k = keys.decoded(torch.arange(c0, c1, device=q.device), pending=pending)[None]
        rows = max(1, _TORCH_BUDGET // (h * d * (c1 - c0)))
        for s in range(0, qn, rows):
            out[s : s + rows, c0:c1] = _ordered_scores(q[s : s + rows], w[s : s + rows], k)
    return out.masked_fill_(torch.arange(n, device=q.device)[None, :] >= limit[:, None], float("-inf"))


def index_scores_at(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: StoredKeys,
    entries: torch.Tensor,
    limit: torch.Tensor,
    *,
    pending: list[PendingCheck] | None = None,
) -> torch.Tensor:
    """Scores of the entries each query names: fp32 [Q, C], −inf where ``entries[t, c]`` is < 0 or ≥ ``limit[t]``.

    Args:
        q, w, keys, limit, pending: as `index_scores`.
        entries: int64 [Q, C] entry ids per query (−1 for an empty slot).
    Raises:
        ValueError: a visible named packed entry holds a scale byte outside 1..252 (see ``pending``); keys, w
            and limit as `index_scores`; entries not [Q, C].
    """
    _check_inputs(q, w, limit, [keys], entries)
    limit = limit.clamp(0, keys.num_entries)
    out = _native(q, w, keys, limit, entries, entries.shape[1], pending=pending)
    if out is not None:
        return out
    qn, h, d = q.shape
    ok = (entries >= 0) & (entries < limit[:, None])
    out = torch.full(entries.shape, float("-inf"), device=q.device)
    rows = max(1, _TORCH_BUDGET // max(1, h * d * entries.shape[1]))
    for s in range(0, qn, rows):
        e, m = entries[s : s + rows], ok[s : s + rows]
        k = torch.zeros(*e.shape, d, device=q.device)
        k[m] = keys.decoded(e[m], pending=pending)
        out[s : s + rows] = _ordered_scores(q[s : s + rows], w[s : s + rows], k).masked_fill_(
            ~m, float("-inf")
        )
    return out


def index_scores_runs(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: StoredKeys,
    offsets: torch.Tensor,
    limit: torch.Tensor,
    width: int,
    *,
    pending: list[PendingCheck] | None = None,
    maxima: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """Scores of every entry of each query's own run of one table (a batch's requests in one pool): fp32
    [Q, width], row t entry c scoring entry ``offsets[t] + c`` of ``keys``, −inf at ``c ≥ limit[t]``. The same
    numbers as `index_scores_each` with ``entries`` None over each run as its own keys, in one kernel call.

    Args:
        q, w, pending: as `index_scores`.
        keys: the shared keys (`kvdiet.model.batch_tables.BatchTables.keys`).
        offsets: int64 [Q] each query's first entry (`BatchTables.offsets`).
        limit: int64 [Q] entries of its run visible to each query, at most the run's own entries (no query may
            read into the next run).
        width: C, the columns of the result (the most entries of any run).
        maxima: None, or (out fp32 [Q, ceil(C / block)] contiguous, block): filled with `block_max` of the
            scores (the compiled kernel's as it scores, where block divides its 64-entry tiles; else from them).
    Raises:
        ValueError: as `index_scores`; offsets not int64 [Q], or offsets or limit on another device than q;
            width < 0; on the CPU, a run starting before entry 0 or reaching past the keys' N.
    """
    _check_inputs(q, w, limit, [keys])
    qn = q.shape[0]
    if offsets.dtype != torch.int64 or tuple(offsets.shape) != (qn,) or offsets.device != q.device:
        raise ValueError(
            f"runs of {qn} queries take offsets int64 [{qn}] on {q.device}, got {offsets.dtype}"
            f" {tuple(offsets.shape)} on {offsets.device}"
        )
    if width < 0 or limit.device != q.device:
        raise ValueError(f"runs take width >= 0 and limit on {q.device}, got {width} and {limit.device}")
    limit = limit.clamp(0, width)
    # the kernel reads the rows of entries offsets[t] .. offsets[t] + limit[t] - 1 (the torch path masks them
    # instead: no device sync there)
    n = keys.num_entries
    if qn and q.is_cpu and bool(((offsets < 0) | (offsets > n) | (limit > n - offsets)).any()):  # no wrap
        raise ValueError(
            f"a run of entries starts before 0 or reaches past the {keys.num_entries} entries held"
        )
    out = _native(q, w, keys, limit, None, width, offsets=offsets, pending=pending, maxima=maxima)
    if out is not None:
        return out
    # the torch path: named entries, a column chunk at a time (index_scores_at splits only rows)
    out = torch.empty(qn, width, device=q.device)
    step = max(1, _TORCH_BUDGET // max(1, q.shape[1] * q.shape[2]))
    for c0 in range(0, width, step):
        cols = torch.arange(c0, min(width, c0 + step), device=q.device)[None, :]
        entries = torch.where(cols < limit[:, None], offsets[:, None] + cols, -1)
        out[:, c0 : c0 + step] = index_scores_at(q, w, keys, entries, offsets + limit, pending=pending)
    return _fill_maxima(out, maxima)


def index_scores_each(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: Sequence[StoredKeys],
    entries: torch.Tensor | None,
    limit: torch.Tensor,
    *,
    host_limit: Sequence[int] | None = None,
    pending: list[PendingCheck] | None = None,
    maxima: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """`index_scores_at` of each query against its own keys (``keys[t]``: one request's stored keys in a batch):
    fp32 [Q, C], the same numbers as Q calls of one query each, written in place (one kernel call per query, no
    copies).

    ``entries`` None scores every entry as `index_scores` does, with no per-entry ids: row t holds entries
    0 … C − 1 of ``keys[t]`` with C the most entries any of them holds, −inf at or past ``limit[t]`` (and past
    its own N). That is `index_scores_at` of ``arange(C)`` per query, bit for bit, without that [Q, C] int64
    tensor (8 MB per request at 1M tokens and ratio 1). ``host_limit``: None, or ``limit``'s Q values as host
    ints (the caller's own, equal to them): a limit they place in [0, N] is not clamped again on the device, and
    where ``entries`` is None they serve as in `index_scores`. ``pending``: as `index_scores`. ``maxima`` (with
    ``entries`` None): as `index_scores_runs`.

    Raises:
        ValueError: as `index_scores_at`; not one `StoredKeys` per query; ``host_limit`` not Q values.
    """
    _check_inputs(q, w, limit, keys, entries)
    if len(keys) != q.shape[0]:
        raise ValueError(f"index_scores_each takes one StoredKeys per query: {q.shape[0]}, got {len(keys)}")
    if host_limit is not None and len(host_limit) != q.shape[0]:  # host ints: free to check
        raise ValueError(f"index scores: host_limit holds {len(host_limit)} values for {q.shape[0]} queries")
    width = max((k.num_entries for k in keys), default=0) if entries is None else entries.shape[1]
    out = torch.empty(q.shape[0], width, device=q.device)
    whole = len(keys) == 1  # one query: its tensors as they are, no views of them
    for t, k in enumerate(keys):
        one = slice(t, t + 1)
        qt, wt, lt, ot = (q, w, limit, out) if whole else (q[one], w[one], limit[one], out[one])
        ids = entries if whole or entries is None else entries[one]
        ht = None if host_limit is None else host_limit[one]
        lim = lt if ht is not None and 0 <= ht[0] <= k.num_entries else lt.clamp(0, k.num_entries)
        mt = (
            None if maxima is None or ids is not None else (maxima[0] if whole else maxima[0][one], maxima[1])
        )
        if _native(qt, wt, k, lim, ids, width, out=ot, pending=pending, maxima=mt) is not None:
            continue
        if ids is not None:
            ot[:] = index_scores_at(qt, wt, k, ids, lt, pending=pending)
        else:
            ot[:, k.num_entries :] = float("-inf")
            ot[:, : k.num_entries] = index_scores(qt, wt, k, lt, host_limit=ht, pending=pending)
            _fill_maxima(ot, mt)
    return out


def _native(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: StoredKeys,
    limit: torch.Tensor,
    entries: torch.Tensor | None,
    width: int,
    *,
    out: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
    pending: list[PendingCheck] | None = None,
    maxima: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor | None:
    """The compiled kernel's scores fp32 [Q, width] (into ``out`` when given: contiguous, on the CPU), or None
    where the pure-torch path runs (off the CPU; exact-mode keys of a float dtype other than fp32). ``offsets``
    int64 [Q] (``entries`` None): query t's entry c is entry ``offsets[t] + c`` of ``keys``. A bad scale byte
    raises after ``pending``'s checks (`run_checks`: an earlier failed check's error first)."""
    on_cpu = q.device.type == "cpu" and keys.rows.device.type == "cpu"
    kernels = native.fp4_kernels() if on_cpu and keys.rows.dtype in (torch.uint8, torch.float32) else None
    if kernels is None:
        return None
    out = torch.empty(q.shape[0], width) if out is None else out
    none = torch.empty(0, 0, dtype=torch.int64)
    blocks, block = maxima if maxima is not None else (none, 0)  # not fused: filled from the scores after
    fused = block > 0 and _TILE % block == 0 and blocks.dtype == torch.float32 and blocks.is_contiguous()
    bad = kernels.index_scores(
        q.float().contiguous(),
        w.float().contiguous(),
        keys.rows,
        keys.table.contiguous(),
        keys.per_block,
        limit.contiguous(),
        none if entries is None else entries.contiguous(),
        none.view(0) if offsets is None else offsets.contiguous(),
        out,
        blocks if fused else none.view(0).float(),
        block if fused else 0,
    )
    if bad >= 0 and pending:
        run_checks(pending)
    _check_scales(bad)
    return out if fused else _fill_maxima(out, maxima)


def _fill_maxima(scores: torch.Tensor, maxima: tuple[torch.Tensor, int] | None) -> torch.Tensor:
    """``scores``, with ``maxima``'s tensor (when given) set to their `block_max`."""
    if maxima is not None:
        maxima[0].copy_(block_max(scores, maxima[1]))
    return scores


def _check_inputs(
    q: torch.Tensor,
    w: torch.Tensor,
    limit: torch.Tensor,
    keys: Sequence[StoredKeys],
    entries: torch.Tensor | None = None,
) -> None:
    """Raise ValueError unless q is [Q, H, d], w [Q, H], limit [Q], entries (when given) [Q, C], and every
    ``keys[i].rows`` hold entries of head dim d: uint8 [R, 17·d/32] (MXFP4) or floating-point [R, d] (exact mode).
    The kernel reads w, limit and entries by q's shape and d values of each row: past them otherwise."""
    if q.dim() != 3:
        raise ValueError(f"index scores take q [Q, H, d], got {tuple(q.shape)}")
    qn, h, d = q.shape
    if tuple(w.shape) != (qn, h) or tuple(limit.shape) != (qn,):
        raise ValueError(
            f"index scores of q {tuple(q.shape)} take w [{qn}, {h}] and limit [{qn}], got {tuple(w.shape)} and"
            f" {tuple(limit.shape)}"
        )
    if entries is not None and (entries.dim() != 2 or entries.shape[0] != qn):
        raise ValueError(f"index scores of {qn} queries take entries [{qn}, C], got {tuple(entries.shape)}")
    for k in keys:
        rows = k.rows
        packed = rows.dtype == torch.uint8
        if (
            rows.dim() != 2
            or rows.shape[1] != (17 * d // 32 if packed else d)
            or not (packed or rows.is_floating_point())
        ):
            raise ValueError(
                f"index keys of head dim {d} are uint8 [R, {17 * d // 32}] or floating-point [R, {d}], got"
                f" {rows.dtype} {tuple(rows.shape)}"
            )


def _check_scales(bad: int) -> None:
    """Raise ValueError when the kernel reported entry ``bad`` (≥ 0) holding a scale byte outside 1..252."""
    if bad >= 0:
        raise ValueError(f"index key entry {bad} holds a scale byte outside 1..252")


def _ordered_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """fp32 [Q, C] in the kernel's order from q [Q, H, d], w [Q, H] and keys [Q or 1, C, d]."""
    prod = (q[:, :, None, :] * k[:, None, :, :]).unflatten(-1, (-1, LANES))  # [Q, H, C, d/8, 8]
    acc = prod[..., 0, :]
    for i in range(1, prod.shape[-2]):
        acc = acc + prod[..., i, :]
    half = acc[..., :4] + acc[..., 4:]
    dots = (half[..., 0] + half[..., 2]) + (half[..., 1] + half[..., 3])  # [Q, H, C]
    terms = torch.where(dots < 0, 0.0, dots) * w[:, :, None]
    total = terms[:, 0]
    for h in range(1, terms.shape[1]):
        total = total + terms[:, h]
    return total
