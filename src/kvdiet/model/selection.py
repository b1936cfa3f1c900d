"""Top-k and candidate-block selection over indexer scores, deterministic and never yielding a bad index.

Shared by the cached path and the no-cache reference (`kvdiet.model.reference`). Scores are fp32
``[Q, N]`` with ``-inf`` for entries a query may not see; NaN is treated as ``-inf`` (case B11c).

Ties are broken by the lowest entry index (case B11a): the result never depends on a sort's
stability or on the thread count. A query that sees fewer than ``k`` entries gets ``valid = False`` in the
remaining slots, and the index there is 0, not −1: in PyTorch a −1 silently gathers the last row, so no
−1 is ever produced (case B11b). Callers mask invalid slots out of the softmax.

On the CPU the compiled kernels (``formats/topk_kernels.cpp``: on a long row one vectorised pass keeps the
entries reaching a threshold guessed from a sample, then a radix select on the scores' bits picks among them)
choose the same sets as the pure-torch path below, which runs with ``KVDIET_NATIVE_KERNELS=0``, on other
devices, or where the build failed; tests hold the two equal with `torch.equal`.
"""

from __future__ import annotations

import torch

from kvdiet.formats import native

__all__ = [
    "block_max",
    "candidate_entries",
    "candidate_mask",
    "select_candidate_blocks",
    "select_topk",
    "select_topk_at",
    "visibility_mask",
    "visible_entries",
]


def _nan_to_neginf(scores: torch.Tensor) -> torch.Tensor:
    """fp32 copy with NaN replaced by −inf (±inf kept; ``torch.nan_to_num`` would make them finite)."""
    inf = float("inf")
    return torch.nan_to_num(scores.float(), nan=-inf, posinf=inf, neginf=-inf)  # one pass


def visible_entries(positions: torch.Tensor, num_entries: int, compress_ratio: int) -> torch.Tensor:
    """How many entries each query sees: entry j is visible at position t iff ``j < (t + 1) // r`` (v41-spec
    §2; case B05), so the visible entries are a prefix.

    Args:
        positions: int64 [Q] absolute query positions.
        num_entries: N, entries held.
        compress_ratio: r ≥ 1.
    Returns:
        int64 [Q], each in [0, N].
    """
    return torch.div(positions + 1, compress_ratio, rounding_mode="floor").clamp_(max=num_entries)


def visibility_mask(positions: torch.Tensor, num_entries: int, compress_ratio: int) -> torch.Tensor:
    """`visible_entries` as a mask: bool [Q, N]."""
    limit = visible_entries(positions, num_entries, compress_ratio)
    return torch.arange(num_entries, device=positions.device)[None, :] < limit[:, None]


def select_topk(
    scores: torch.Tensor, k: int, *, maxima: tuple[torch.Tensor, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``min(k, N)`` highest scores of each row other than ``-inf`` and NaN (``+inf`` the highest of all), ties
    to the lowest index, sorted by index.

    Args:
        scores: fp32 [Q, N] (another float dtype is compared as fp32: the indexer's scores are fp32); ``-inf``
            (or NaN) marks entries that must not be chosen.
        k: entries wanted per row (config ``index_topk``).
        maxima: None, or (`block_max` of ``scores`` fp32 [Q, ceil(N / block)], block): the compiled selection
            then finds a long row's candidates through them instead of a pass over the row (the same sets: an
            entry reaching a threshold lies in a block whose max reaches it). Other maxima give other sets;
            maxima not fp32 or not contiguous are not read, nor on the pure-torch path.
    Returns:
        ``(idx, valid)``: int64 [Q, min(k, N)] entry indices in ascending order, and bool of the same
        shape; ``idx`` is 0 wherever ``valid`` is False.
    Raises:
        ValueError: ``k < 1`` or ``scores`` is not 2-D.
        TypeError: ``scores`` is not a float tensor (integers past 2²⁴ would not compare exactly as fp32).
        RuntimeError: (compiled path) ``maxima`` of another shape than [Q, ceil(N / block)] or not on the CPU.
    """
    if k < 1 or scores.dim() != 2:
        raise ValueError(f"select_topk needs k >= 1 and 2-D scores, got k={k}, shape {tuple(scores.shape)}")
    _check_float(scores)
    q, n = scores.shape
    kk = min(k, n)
    if kk == 0:
        empty = torch.zeros(q, 0, dtype=torch.int64, device=scores.device)
        return empty, empty.bool()
    kernels = native.fp4_kernels() if scores.device.type == "cpu" else None
    if kernels is not None:
        idx = torch.empty(q, kk, dtype=torch.int64)
        valid = torch.empty(q, kk, dtype=torch.bool)
        blocks, block = (torch.empty(0), 0) if maxima is None else maxima
        if blocks.numel() and (blocks.dtype != torch.float32 or not blocks.is_contiguous()):
            blocks, block = torch.empty(0), 0  # not what the kernel reads: the pass over the row instead
        kernels.select_topk(_unit_stride(scores), idx, valid, blocks, block)
        return idx, valid
    scores = _nan_to_neginf(scores)
    cpu = scores.device.type == "cpu"
    # on the CPU one more value tells whether an entry equal to the threshold is left out: the (k+1)-th
    # largest equals the k-th exactly then (checked on the CPU only: on a GPU it would stop the stream)
    top = scores.topk(kk + 1 if cpu and kk < n else kk, dim=-1)
    values, indices = top.values[:, :kk], top.indices[:, :kk]
    threshold = values[:, -1:]
    if cpu and (kk == n or bool((top.values[:, kk] < threshold[:, 0]).all())):
        # no row leaves an entry equal to its threshold out: topk's set is the only one, whatever its order
        marked = indices.masked_fill(values == float("-inf"), n)
    elif cpu:  # ties at the threshold: the lowest indices among them, as the contract says
        marked = _lowest_ties(scores, threshold, kk)
    else:  # the same without nonzero (no stream sync on a GPU)
        tied = scores == threshold
        above = scores > threshold
        room = kk - above.sum(-1, keepdim=True)
        chosen = (above | (tied & (tied.cumsum(-1) <= room))) & (scores > float("-inf"))
        positions = torch.arange(n, device=scores.device).expand(q, n)
        marked = torch.where(chosen, positions, torch.full_like(positions, n))
        marked = marked.topk(kk, dim=-1, largest=False).values
    idx = marked.sort(dim=-1).values
    valid = idx < n
    return idx.masked_fill(~valid, 0), valid


def _check_float(scores: torch.Tensor) -> None:
    if not scores.is_floating_point():
        raise TypeError(f"scores must be a float tensor (fp32), got {scores.dtype}")


def _unit_stride(scores: torch.Tensor) -> torch.Tensor:
    """fp32 [Q, N] with unit element stride (no copy when ``scores`` already is)."""
    scores = scores.float()
    return scores if scores.shape[1] <= 1 or scores.stride(1) == 1 else scores.contiguous()


def _lowest_ties(scores: torch.Tensor, threshold: torch.Tensor, kk: int) -> torch.Tensor:
    """The chosen entries of `select_topk` when ties at the threshold are left out: int64 [Q, kk], each row's
    entries above ``threshold`` [Q, 1] and then its lowest-index entries equal to it (finite only), ascending,
    ``N`` in the slots past them. Reads the [Q, N] scores in three passes (no sort or top-k over them)."""
    q, n = scores.shape
    above = scores > threshold
    tied = (scores == threshold) & (threshold > float("-inf"))
    room = kk - above.sum(-1)  # >= 1: fewer than kk entries lie above the k-th largest
    tied_rows, tied_cols = tied.nonzero(as_tuple=True)  # row-major: ascending entries within a row
    per_row = torch.bincount(tied_rows, minlength=q)
    rank = torch.arange(tied_rows.numel()) - (per_row.cumsum(0) - per_row)[tied_rows]
    keep = rank < room[tied_rows]
    above_rows, above_cols = above.nonzero(as_tuple=True)
    key = (
        torch.cat([above_rows * (n + 1) + above_cols, (tied_rows * (n + 1) + tied_cols)[keep]]).sort().values
    )
    rows, cols = key // (n + 1), key % (n + 1)
    per_row = torch.bincount(rows, minlength=q)
    slot = torch.arange(rows.numel()) - (per_row.cumsum(0) - per_row)[rows]
    marked = torch.full((q, kk), n, dtype=torch.int64)
    marked[rows, slot] = cols
    return marked


def select_topk_at(
    scores: torch.Tensor, entries: torch.Tensor, k: int, num_entries: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_topk` over the scores of named entries only: the same result as `select_topk` of dense ``[Q, N]``
    scores that are −inf outside ``entries``, provided each row of ``entries`` ascends with no entry twice.

    Args:
        scores: fp32 [Q, C], the scores of ``entries`` (−inf where an entry must not be chosen).
        entries: int64 [Q, C] entry ids, ascending along each row (a slot scored −inf may hold any id).
        k: entries wanted per row (config ``index_topk``); num_entries: N.
    Returns:
        ``(idx, valid)``: int64 / bool [Q, min(k, N)], as `select_topk`.
    Raises:
        ValueError: ``k < 1``.
    """
    if k < 1:
        raise ValueError(f"select_topk_at needs k >= 1, got {k}")
    q, c = scores.shape
    kk = min(k, num_entries)
    if c and kk:
        pos, ok = select_topk(scores, k)
        if pos.shape[1] >= kk:  # no column left to fill: the chosen ones as they are (their first kk)
            if pos.shape[1] > kk:
                pos, ok = pos[:, :kk], ok[:, :kk].contiguous()
            return torch.where(ok, entries.gather(1, pos), 0), ok
    idx = torch.zeros(q, kk, dtype=torch.int64, device=scores.device)
    valid = torch.zeros(q, kk, dtype=torch.bool, device=scores.device)
    if c and kk:
        m = pos.shape[1]  # columns past it are invalid: valid slots come first
        idx[:, :m] = entries.gather(1, pos).masked_fill_(~ok, 0)
        valid[:, :m] = ok
    return idx, valid


def select_candidate_blocks(
    scores: torch.Tensor,
    visible: torch.Tensor,
    *,
    block_size: int,
    topk_blocks: int,
    block_scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hierarchical candidate pool of the candidate-source indexer (v41-spec §4, ``select_candidate_blocks``).

    Block score = max of its ``block_size`` position scores (``-inf`` padding); the block holding the
    newest visible entry is pinned to ``+inf`` because it may be partly filled; the top
    ``min(topk_blocks, n_blocks)`` blocks with a finite or pinned score are kept.

    Args:
        scores: fp32 [Q, N] scores, ``-inf`` where not visible.
        visible: int64 [Q] entries visible to each query (`visible_entries`; the newest is ``visible − 1``).
        block_size: positions per block (config ``candidate_block_size``).
        topk_blocks: blocks kept (config ``candidate_topk_blocks``).
        block_scores: None, or `block_max` of ``scores`` with ``block_size`` (the index kernel's, taken as it
            scored): used instead of computing them (not modified).
    Returns:
        ``(block ids int64 [Q, Kb], valid bool [Q, Kb])`` as from `select_topk`; expand with `candidate_mask`
        or `candidate_entries`.
    Raises:
        TypeError: ``scores`` is not a float tensor.
    """
    _check_float(scores)
    block_scores = block_max(scores, block_size) if block_scores is None else block_scores.clone()
    if block_scores.shape[1]:  # pin each row's newest block where it sees an entry (no host read: no nonzero)
        newest = visible[:, None] - 1  # newest visible entry, -1 if none
        col = torch.div(newest.clamp(min=0), block_size, rounding_mode="floor")
        pinned = torch.where(newest >= 0, float("inf"), block_scores.gather(1, col))
        block_scores.scatter_(1, col, pinned)
    return select_topk(block_scores, topk_blocks)


def block_max(scores: torch.Tensor, block_size: int) -> torch.Tensor:
    """fp32 [Q, ceil(N / block_size)]: each block's max score, NaN read as −inf, the last block padded with −inf."""
    q, n = scores.shape
    nb = -(-n // block_size)
    kernels = native.fp4_kernels() if scores.device.type == "cpu" else None
    if kernels is not None:
        out = torch.empty(q, nb)
        kernels.block_max(_unit_stride(scores), block_size, out)
        return out
    clean = _nan_to_neginf(scores)
    if n % block_size:  # the last block padded with -inf
        clean = torch.cat([clean, clean.new_full((q, nb * block_size - n), float("-inf"))], dim=1)
    return clean.reshape(q, nb, block_size).amax(-1)


def candidate_mask(
    blocks: torch.Tensor, valid: torch.Tensor, *, num_entries: int, block_size: int
) -> torch.Tensor:
    """Expand kept blocks ``[Q, Kb]`` to bool [Q, num_entries]: True inside a kept block.

    At most ``Kb × block_size`` entries per row are True, and only within valid blocks.
    """
    q = blocks.shape[0]
    keep = torch.zeros(q, -(-num_entries // block_size), dtype=torch.bool, device=blocks.device)
    rows = torch.arange(q, device=blocks.device)[:, None].expand_as(blocks)
    keep[rows[valid], blocks[valid]] = True
    return keep.repeat_interleave(block_size, dim=1)[:, :num_entries]


def candidate_entries(blocks: torch.Tensor, valid: torch.Tensor, *, block_size: int) -> torch.Tensor:
    """The entries of kept blocks ``[Q, Kb]``: int64 [Q, Kb × block_size], ascending along each row (blocks
    ascend, as `select_topk` returns them), −1 in the slots of invalid blocks. Ids may reach past the entries
    held (the newest block may be partly filled): score them with a visibility limit."""
    ids = blocks[:, :, None] * block_size + torch.arange(block_size, device=blocks.device)
    return ids.masked_fill_(~valid[:, :, None], -1).flatten(1)
