"""Top-k, candidate blocks and the masked softmax (cases B05, B11; v41-spec §4), on the compiled selection
kernels and on the pure-torch path, and the two against each other exactly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdiet.formats import native
from kvdiet.model.attention import attend
from kvdiet.model.selection import (
    block_max,
    candidate_entries,
    candidate_mask,
    select_candidate_blocks,
    select_topk,
    select_topk_at,
    visibility_mask,
)

pytestmark = pytest.mark.usefixtures("format_backend")  # compiled kernels and pure torch

NEG = float("-inf")
NAN = float("nan")
INF = float("inf")


def test_b11a_all_equal_scores_pick_lowest_indices() -> None:
    idx, valid = select_topk(torch.zeros(3, 20), 8)
    assert idx.tolist() == [list(range(8))] * 3 and bool(valid.all())


def test_b11b_fewer_visible_than_k() -> None:
    visible = visibility_mask(torch.tensor([10]), 20, 2)  # query at position 10, r = 2 → entries 0..4
    assert visible[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    scores = torch.randn(1, 20).masked_fill(~visible, NEG)
    idx, valid = select_topk(scores, 8)
    assert idx.shape == (1, 8) and valid.sum().item() == 5
    assert idx[valid].tolist() == [0, 1, 2, 3, 4]
    assert (idx >= 0).all()  # no −1 ever: invalid slots hold 0 and valid=False


def test_integer_scores_are_refused() -> None:
    """Integers past 2**24 would compare wrongly as fp32 (2**24 + 1 ties 2**24): a clear error instead."""
    scores = torch.tensor([[2**24, 2**24 + 1]])
    with pytest.raises(TypeError, match="float tensor"):
        select_topk(scores, 1)
    with pytest.raises(TypeError, match="float tensor"):
        select_candidate_blocks(scores, torch.tensor([2]), block_size=1, topk_blocks=1)


def test_b11c_nan_and_inf_scores() -> None:
    scores = torch.tensor([[NEG, float("nan"), 1.0, NEG, float("nan"), 0.5]])
    idx, valid = select_topk(scores, 4)
    assert idx[valid].tolist() == [2, 5] and valid.sum().item() == 2


def test_b11_masked_slots_equal_dense_over_visible() -> None:
    torch.manual_seed(0)
    q, win, entries, sink = torch.randn(1, 2, 16), torch.randn(6, 16), torch.randn(20, 16), torch.randn(2)
    idx = torch.tensor([[0, 1, 2, 3, 4, 0, 0, 0]])
    valid = torch.tensor([[True] * 5 + [False] * 3])
    entries_sparse = entries[idx].clone()
    entries_sparse[~valid] = 1e6  # whatever an invalid slot gathers must not matter
    win_mask = torch.ones(1, 6, dtype=torch.bool)
    got = attend(q, win, win_mask, entries_sparse, valid, sink, 0.25)
    dense = attend(q, win, win_mask, entries[:5][None], torch.ones(1, 5, dtype=torch.bool), sink, 0.25)
    assert torch.allclose(got, dense, atol=1e-6) and torch.isfinite(got).all()


def test_sink_only_when_nothing_visible() -> None:
    q = torch.randn(1, 2, 8)
    out = attend(q, torch.randn(3, 8), torch.zeros(1, 3, dtype=torch.bool), None, None, torch.zeros(2), 1.0)
    assert torch.equal(out, torch.zeros(1, 2, 8))  # all mass on the sink, whose value is 0


def test_b05_visible_sets() -> None:
    vis = visibility_mask(torch.arange(7), 4, 2)
    assert [row.nonzero().flatten().tolist() for row in vis] == [
        [],
        [0],
        [0],
        [0, 1],
        [0, 1],
        [0, 1, 2],
        [0, 1, 2],
    ]
    vis4 = visibility_mask(torch.tensor([2, 3, 6, 7]), 4, 4)
    assert [int(row.sum()) for row in vis4] == [0, 1, 1, 2]


def test_candidates_pin_newest_block() -> None:
    n, bs = 40, 4
    visible = visibility_mask(torch.tensor([33]), n, 1)  # entries 0..33; newest block 8 holds 32, 33
    scores = (
        torch.arange(n, dtype=torch.float32).flip(0)[None].masked_fill(~visible, NEG)
    )  # oldest score highest
    blocks, valid = select_candidate_blocks(scores, visible.sum(-1), block_size=bs, topk_blocks=2)
    assert sorted(blocks[valid].tolist()) == [0, 8]  # best block by max score, plus the pinned newest
    pool = candidate_mask(blocks, valid, num_entries=n, block_size=bs) & visible
    assert pool[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 32, 33]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 70),
    pos=st.integers(0, 80),
    bs=st.integers(1, 8),
    kb=st.integers(1, 5),
    seed=st.integers(0, 10_000),
)
def test_candidate_pool_bounds(n: int, pos: int, bs: int, kb: int, seed: int) -> None:
    visible = visibility_mask(torch.tensor([pos]), n, 1)
    scores = torch.randn(1, n, generator=torch.Generator().manual_seed(seed)).round(decimals=1)
    scores = scores.masked_fill(~visible, NEG)
    blocks, valid = select_candidate_blocks(scores, visible.sum(-1), block_size=bs, topk_blocks=kb)
    mask = candidate_mask(blocks, valid, num_entries=n, block_size=bs)
    assert int(mask.sum()) <= kb * bs  # never more than the kept blocks hold
    seen = int(visible.sum())
    if seen:
        assert mask[0, seen - 1]  # the newest visible entry is always a candidate
    again = select_candidate_blocks(scores, visible.sum(-1), block_size=bs, topk_blocks=kb)
    assert torch.equal(again[0], blocks) and torch.equal(again[1], valid)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 50), k=st.integers(1, 12), seed=st.integers(0, 10_000), ties=st.booleans())
def test_topk_matches_sorted_reference(n: int, k: int, seed: int, ties: bool) -> None:
    """Many ties (the lowest index wins at the threshold) or distinct scores (topk's own set, the fast path);
    −inf entries never chosen; valid slots first, ascending, invalid ones 0."""
    gen = torch.Generator().manual_seed(seed)
    if ties:
        scores = torch.randint(-3, 3, (2, n), generator=gen).float()
    else:
        scores = torch.stack([torch.randperm(n, generator=gen) for _ in range(2)]).float()
    scores[torch.rand(2, n, generator=gen) < 0.3] = NEG
    idx, valid = select_topk(scores, k)
    for row in range(2):
        ranked = sorted(
            (i for i in range(n) if scores[row, i] > NEG), key=lambda i: (-scores[row, i].item(), i)
        )
        assert sorted(ranked[:k]) == idx[row][valid[row]].tolist()
        m = int(valid[row].sum())
        assert valid[row][:m].all() and not valid[row][m:].any() and not idx[row][m:].any()


def test_topk_rows_of_every_kind_in_one_call() -> None:
    """Rows that take different branches in one call (nothing visible, all tied, distinct, fewer finite
    entries than k, ties above and at the threshold) each get the sorted reference's set."""
    n, k = 300, 7
    gen = torch.Generator().manual_seed(3)
    scores = torch.stack(
        [
            torch.full((n,), NEG),
            torch.full((n,), 2.0),
            torch.randperm(n, generator=gen).float(),
            torch.where(torch.arange(n) % 100 == 0, 1.0, NEG),
            torch.randint(0, 4, (n,), generator=gen).float(),
        ]
    )
    idx, valid = select_topk(scores, k)
    for row in range(scores.shape[0]):
        ranked = sorted(
            (i for i in range(n) if scores[row, i] > NEG), key=lambda i: (-scores[row, i].item(), i)
        )
        assert idx[row][valid[row]].tolist() == sorted(ranked[:k])
        assert not idx[row][~valid[row]].any()


def _ranked(scores: torch.Tensor, k: int) -> torch.Tensor:
    """An independent oracle: each row's ``k`` best entries by a stable descending sort (NaN as −inf, −0 as
    +0), −inf ones dropped; [Q, k] ascending, ``N`` in the slots past them."""
    clean = torch.nan_to_num(scores, nan=NEG, posinf=INF, neginf=NEG) + 0.0  # -0.0 + 0.0 = +0.0
    order = clean.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    order = order.masked_fill(clean.gather(1, order) == NEG, scores.shape[1])
    return order.sort(dim=-1).values


# scores drawn from a few values: ties everywhere, with both zeros, both infinities and NaN among them
_POOL = [NEG, NAN, INF, -0.0, 0.0, -1.5, 1.5, 2.0, 3.25, 1e-40, -1e-40]


@settings(max_examples=80, deadline=None)
@given(
    q=st.integers(1, 5),
    n=st.integers(1, 300),
    k=st.one_of(st.just(1), st.integers(1, 40), st.integers(300, 400)),
    seed=st.integers(0, 10_000),
)
def test_compiled_topk_equals_pure_torch(both, q: int, n: int, k: int, seed: int) -> None:
    """Native and pure-torch top-k give the same tensors on ties, ±inf, NaN, ±0, subnormals, k = 1 and k ≥ N,
    rows of different visible lengths and rows with a stride wider than N; both equal the stable-sort oracle."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor(_POOL)
    wide = pool[torch.randint(len(_POOL), (q, n + 3), generator=gen)]
    wide[:, : n // 2] += torch.randint(0, 3, (q, n // 2), generator=gen).float()  # some distinct values too
    limit = torch.randint(0, n + 1, (q, 1), generator=gen)
    scores = wide[:, :n].masked_fill(torch.arange(n) >= limit, NEG)  # a prefix visible, as on the real path
    strided = wide[:, :n]  # row stride n + 3
    for rows in (scores, strided):
        (idx, valid), (want_idx, want_valid) = both(select_topk, rows, k)
        assert torch.equal(idx, want_idx) and torch.equal(valid, want_valid)
        assert torch.equal(torch.where(valid, idx, n), _ranked(rows, min(k, n)))


def test_compiled_topk_equals_pure_torch_on_long_rows(both) -> None:
    """Rows long enough for the compiled kernel's sampled threshold and every radix level: keys equal in all but
    their low bits (the threshold bin refined twice), values tiled every 4,096 entries as `bench_decode`'s caches
    are (ties at the threshold), distinct values, mostly invisible rows, all equal, and a row whose evenly spaced
    scores (every 16th: the kernel's sample) are its best, too few to be the top k (the guess fails)."""
    n, k = 65_536, 513
    gen = torch.Generator().manual_seed(7)
    near = (torch.randint(0, 1 << 12, (n,), generator=gen, dtype=torch.int32) + 0x3F800000).view(
        torch.float32
    )
    misleading = torch.rand(n, generator=gen)
    misleading[: 16 * 100 : 16] = 5.0
    scores = torch.stack(
        [
            near,
            -near,
            torch.randn(4096, generator=gen).repeat(n // 4096 + 1)[:n],
            torch.randn(n, generator=gen),
            torch.randn(n, generator=gen).masked_fill(torch.arange(n) >= 700, NEG),
            torch.full((n,), 0.5),
            misleading,
        ]
    )
    (idx, valid), (want_idx, want_valid) = both(select_topk, scores, k)
    assert torch.equal(idx, want_idx) and torch.equal(valid, want_valid)
    assert torch.equal(torch.where(valid, idx, n), _ranked(scores, k))
    assert int(valid[4].sum()) == 513 and idx[5].tolist() == list(range(k))
    assert set(range(0, 1600, 16)) <= set(idx[6].tolist())


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 200), bs=st.integers(1, 9), kb=st.integers(1, 12), seed=st.integers(0, 10_000))
def test_compiled_candidates_and_topk_at_equal_pure_torch(both, n: int, bs: int, kb: int, seed: int) -> None:
    """Candidate blocks (block max with NaN as −inf, the last block partly filled, the newest pinned) and the
    top-k over a candidate pool: the same tensors on both paths."""
    gen = torch.Generator().manual_seed(seed)
    q = 3
    scores = torch.tensor(_POOL)[torch.randint(len(_POOL), (q, n), generator=gen)]
    visible = torch.randint(0, n + 1, (q,), generator=gen)
    scores = scores.masked_fill(torch.arange(n) >= visible[:, None], NEG)
    got, want = both(select_candidate_blocks, scores, visible, block_size=bs, topk_blocks=kb)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    entries = candidate_entries(*want, block_size=bs)
    pooled = torch.where((entries >= 0) & (entries < n), scores.gather(1, entries.clamp(0, n - 1)), NEG)
    got, want = both(select_topk_at, pooled, entries, 5, n)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _folded_block_max(scores: torch.Tensor, block: int) -> torch.Tensor:
    """Each block's max as a scalar fold in entry order (``x > m``: NaN never, of equal -0 / +0 the first)."""
    q, n = scores.shape
    out = torch.full((q, -(-n // block)), NEG)
    for r in range(q):
        for b in range(out.shape[1]):
            m = torch.tensor(NEG)
            for x in scores[r, b * block : (b + 1) * block]:
                m = x if bool(x > m) else m
            out[r, b] = m
    return out


def test_block_max_of_eights_keeps_the_scalar_folds_bits(both) -> None:
    """The compiled block max (two blocks of 8 per vector, a scalar fold for the rest) gives the fold's bits:
    the first of equal zeros (-0 before +0 and after it), NaN read as −inf, ±inf, subnormals, a last block
    partly filled, an odd block count, rows of a wider tensor (row stride > N); and pure torch's values. (The
    vector path runs in AVX-512 builds, as on this project's CI machine; elsewhere this holds the scalar fold.)"""
    gen = torch.Generator().manual_seed(3)
    zeros = torch.tensor([-0.0, 0.0, 0.0, -0.0, NAN, -0.0, NEG, 0.0] * 4)
    pool = torch.tensor([NAN, NEG, INF, -0.0, 0.0, 1e-45, -1e-45, 1.5, -2.0, 1.5])
    wide = pool[torch.randint(len(pool), (3, 300), generator=gen)]
    wide[0, :32] = zeros
    wide[1, :32] = zeros.flip(0)
    wide[2, :8] = NAN
    none = torch.zeros(3, dtype=torch.int64)  # no newest block pinned
    for rows in (wide[:, :250], wide[:, :253], wide[:, :16], wide[:, :7]):
        got, want = both(select_candidate_blocks, rows, none, block_size=8, topk_blocks=4)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        out = torch.empty(3, -(-rows.shape[1] // 8))
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv(native.ENV, raising=False)
            native.fp4_kernels().block_max(rows, 8, out)
        assert torch.equal(out.view(torch.int32), _folded_block_max(rows, 8).view(torch.int32))
    folded = _folded_block_max(wide[:, :32], 8)
    assert folded[0].tolist() == [0.0] * 4 and torch.signbit(folded[0]).tolist() == [True] * 4
    assert torch.signbit(folded[1]).tolist() == [False] * 4 and folded[2, 0].item() == NEG


def _long_rows(seed: int, block: int = 8) -> torch.Tensor:
    """Rows long enough for the block-guided selection (16,384+ blocks of ``block``): distinct scores; every score
    from eight values (ties across thousands of entries at the threshold: most blocks reach it); −inf past a short
    visible prefix (too few valid blocks sampled); NaN and ±inf among distinct scores; all equal; and near-zero
    noise with high scores only at the first entry of each block the sample reads (the guessed threshold then
    finds fewer than k entries: the fallback to the row's own pass)."""
    gen = torch.Generator().manual_seed(seed)
    n = 16_384 * block + 13
    rows = torch.randn(6, n, generator=gen)
    rows[1] = torch.randint(0, 8, (n,), generator=gen).float()
    rows[2, 3_000:] = NEG
    rows[3, torch.randint(0, n, (500,), generator=gen)] = NAN
    rows[3, torch.randint(0, n, (40,), generator=gen)] = INF
    rows[3, torch.randint(0, n, (4_000,), generator=gen)] = NEG
    rows[4] = 0.5
    rows[5] = torch.randn(n, generator=gen) * 1e-3
    sampled = (
        torch.arange(4_096) * (-(-n // block) // 4_096) * block
    )  # topk_kernels.cpp's sample of the maxima
    rows[5, sampled] = 10.0 + torch.rand(4_096, generator=gen)
    return rows


@pytest.mark.parametrize("k", [512, 1, 2048])
def test_select_topk_through_block_maxima_picks_the_same_sets(k: int) -> None:
    """Given the rows' block maxima, the compiled selection reads a long row's candidates only in the blocks that
    reach its threshold: the same indices and validity as the pass over the whole row, ties to the lowest index
    included, on every kind of row; blocks of 8 and of 16; the pure-torch path ignores the maxima."""
    for block in (8, 16):
        rows = _long_rows(k, block)
        maxima = (block_max(rows, block), block)
        got = select_topk(rows, k, maxima=maxima)
        want = select_topk(rows, k)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), block
        assert int(want[1][2].sum()) == min(k, 3_000) and bool(want[1][0].all()) and bool(want[1][5].all())
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(native.ENV, "0")
            pure = select_topk(rows, k, maxima=maxima)
        assert torch.equal(pure[0], want[0]) and torch.equal(pure[1], want[1])


def test_select_topk_reads_the_maxima_it_is_given_and_refuses_misfits() -> None:
    """The compiled selection does read the maxima (a block whose max is given as −inf is never looked into, so
    its best entry is missed: maxima must be the scores' own), and refuses maxima that do not fit the rows
    (another row or block count). The pure-torch path ignores them."""
    rows = _long_rows(0)[:1]
    maxima = block_max(rows, 8)
    best = int(rows[0].argmax())
    hidden = maxima.clone()
    hidden[0, best // 8] = NEG
    picked = select_topk(rows, 8, maxima=(hidden, 8))[0][0].tolist()
    assert (best in picked) == (native.fp4_kernels() is None)
    for misfit in (maxima[:, :-1].contiguous(), block_max(_long_rows(0)[:2], 8)):
        if native.fp4_kernels() is None:
            assert torch.equal(select_topk(rows, 8, maxima=(misfit, 8))[0], select_topk(rows, 8)[0])
        else:
            with pytest.raises(RuntimeError, match="blocks float32"):
                select_topk(rows, 8, maxima=(misfit, 8))
