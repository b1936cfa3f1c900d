"""A compressor's open group (`CompressorTail`) and its batched decode-step updates."""

from __future__ import annotations

import pytest
import torch

from kvdiet.model.compressor_tail import CompressorTail


def _tails(counts: list[int], rows: int = 2, dim: int = 5) -> list[CompressorTail]:
    tails = []
    for i, c in enumerate(counts):
        tail = CompressorTail(rows, dim)
        if c:
            tail.replace(torch.full((c, dim), float(i + 1)), torch.full((c, dim), -float(i + 1)))
        tails.append(tail)
    return tails


def _state(tails: list[CompressorTail]) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    return [(t.kv.clone(), t.score.clone(), t.count) for t in tails]


def _same(a: list[CompressorTail], b: list[CompressorTail]) -> bool:
    """Bit for bit (NaN payloads, −0.0), with the counts."""
    return all(
        torch.equal(x.kv.view(torch.int32), y.kv.view(torch.int32))
        and torch.equal(x.score.view(torch.int32), y.score.view(torch.int32))
        and x.count == y.count
        for x, y in zip(a, b, strict=True)
    )


def test_push_each_pushes_row_b_into_tail_b() -> None:
    kv = torch.tensor([[0.0, -0.0, 1e-45, float("inf"), float("nan")], [3.0, 4.0, 5.0, 6.0, 7.0]])
    score = -kv
    got, want = _tails([0, 1], rows=3), _tails([0, 1], rows=3)
    CompressorTail.push_each(got, kv, score)
    for b, t in enumerate(want):
        t.push(kv[b], score[b])
    assert _same(got, want) and [t.count for t in got] == [1, 2]
    assert torch.equal(
        got[0].kv[0].view(torch.int32), kv[0].view(torch.int32)
    )  # -0.0, NaN and subnormal bits kept


def test_close_each_gives_the_concatenated_groups_and_clears_the_tails() -> None:
    kv, score = torch.arange(15.0).view(3, 5), -torch.arange(15.0).view(3, 5)
    tails = _tails([1, 1, 1])
    want_kv = torch.cat([torch.cat([t.kv[:1], kv[b : b + 1]]) for b, t in enumerate(tails)])
    want_score = torch.cat([torch.cat([t.score[:1], score[b : b + 1]]) for b, t in enumerate(tails)])
    group_kv, group_score = CompressorTail.close_each(tails, kv, score)
    assert torch.equal(group_kv, want_kv) and torch.equal(group_score, want_score)
    assert group_kv[:2, 0].tolist() == [1.0, 0.0] and group_kv.shape == (6, 5)
    assert _same(tails, _tails([0, 0, 0]))


def test_close_each_of_unlike_tails_concatenates_them_one_by_one() -> None:
    tails = _tails([2, 1], rows=4)  # V4-Flash-like: more rows than the group, so no stacking
    kv, score = torch.ones(2, 5), torch.zeros(2, 5)
    group_kv, group_score = CompressorTail.close_each(tails, kv, score)
    assert group_kv[:, 0].tolist() == [1.0, 1.0, 1.0, 2.0, 1.0] and group_score[:, 0].tolist() == [
        -1.0,
        -1.0,
        0.0,
        -2.0,
        0.0,
    ]
    assert _same(tails, _tails([0, 0], rows=4))


@pytest.mark.parametrize("close", [False, True], ids=["push", "close"])
def test_a_full_tail_or_a_row_count_that_differs_changes_nothing(close: bool) -> None:
    tails = _tails([1, 2] if close else [2, 0], rows=2)
    before = _state(tails)
    op = CompressorTail.close_each if close else CompressorTail.push_each
    with pytest.raises((IndexError, ValueError)):
        op(tails, torch.ones(2, 5), torch.ones(2, 5))
    with pytest.raises(ValueError, match="2 tails for 3 kv"):
        op(tails, torch.ones(3, 5), torch.ones(3, 5))
    assert all(
        torch.equal(t.kv, k) and torch.equal(t.score, s) and t.count == c
        for t, (k, s, c) in zip(tails, before, strict=True)
    )


@pytest.mark.parametrize("close", [False, True], ids=["push", "close"])
def test_rows_unlike_a_tail_change_no_tail(close: bool) -> None:
    """A later tail of another width (the per-tail path of close_each) or rows of another dtype: every tail as
    it was, the first (which fits) included."""
    tails = _tails([1, 1], rows=3)
    tails[1] = CompressorTail(3, 6)
    tails[1].replace(torch.ones(1, 6), torch.ones(1, 6))
    before = _state(tails)
    op = CompressorTail.close_each if close else CompressorTail.push_each
    with pytest.raises(ValueError, match="do not fit a tail's"):
        op(tails, torch.ones(2, 5), torch.ones(2, 5))
    alike = _tails([1, 1], rows=3)
    alike_before = _state(alike)
    with pytest.raises(ValueError, match="do not fit a tail's"):
        op(alike, torch.ones(2, 5, dtype=torch.float64), torch.ones(2, 5, dtype=torch.float64))
    for ts, bf in ((tails, before), (alike, alike_before)):
        assert all(
            torch.equal(t.kv, k) and torch.equal(t.score, s) and t.count == c
            for t, (k, s, c) in zip(ts, bf, strict=True)
        )
