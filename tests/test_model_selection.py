"""Top-k, candidate blocks and the masked softmax (cases B05, B11; v41-spec §4)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdiet.model.attention import attend
from kvdiet.model.selection import candidate_mask, select_candidate_blocks, select_topk, visibility_mask

NEG = float("-inf")


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
