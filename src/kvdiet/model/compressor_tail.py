"""`CompressorTail`: a request's open compression group (the rows of a ratio-r compressor whose group has not
completed yet, v41-spec §3), and its batched decode-step updates (one row per request, every request's tail in
one copy call instead of a few torch calls each).

It holds storage only: the compressor (`kvdiet.model.compressor`, `kvdiet.model.decode_step`) decides what to
write; it knows nothing of the pool or the entries a completed group becomes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["CompressorTail"]


class CompressorTail:
    """fp32 projections of the open group's tokens (a ratio-r compressor), kept until the group completes.

    ``rows`` is the group size r for V4.1. V4-Flash's CSA layers keep 2r rows: the last complete window's
    projections (rows ``[0, r)``; zero kv and −inf scores before the first window completes) and then the
    open window's ``count`` rows (`kvdiet.model.v4.compressor`). ``dtype`` is fp64 in a model run in fp64.
    """

    def __init__(
        self, rows: int, dim: int, dtype: torch.dtype = torch.float32, *, device: torch.device | str = "cpu"
    ) -> None:
        self.kv = torch.zeros(rows, dim, dtype=dtype, device=device)
        self.score = torch.full((rows, dim), float("-inf"), dtype=dtype, device=device)
        self.count = 0

    def replace(self, kv: torch.Tensor, score: torch.Tensor) -> None:
        """Hold ``kv``/``score`` [c, dim] (c < ratio) as the open group's rows."""
        c = kv.shape[0]
        self.clear()
        self.kv[:c], self.score[:c] = kv, score
        self.count = c

    def push(self, kv: torch.Tensor, score: torch.Tensor) -> None:
        """Add one row ``kv``/``score`` [dim] to the open group (it must have room: ``count < rows``)."""
        self.kv[self.count], self.score[self.count] = kv, score
        self.count += 1

    def clear(self) -> None:
        """No open group."""
        self.kv.zero_()
        self.score.fill_(float("-inf"))
        self.count = 0

    @property
    def nbytes(self) -> int:
        return (self.kv.numel() + self.score.numel()) * self.kv.element_size()

    @staticmethod
    def push_each(tails: Sequence[CompressorTail], kv: torch.Tensor, score: torch.Tensor) -> None:
        """``tails[b].push(kv[b], score[b])`` for every b (a batched decode step's rows, ``kv``/``score`` [B, dim]),
        the same copies in one call.

        Raises:
            IndexError: a tail has no room (before any tail changes).
            ValueError: ``len(tails) != B``, or rows whose width or dtype differ from a tail's (before any change).
        """
        if len(tails) != kv.shape[0] or len(tails) != score.shape[0]:
            raise ValueError(f"{len(tails)} tails for {kv.shape[0]} kv and {score.shape[0]} score rows")
        _check_rows(tails, kv, score)
        dst = [t.kv[t.count] for t in tails] + [t.score[t.count] for t in tails]
        torch._foreach_copy_(dst, [*kv.unbind(0), *score.unbind(0)])
        for t in tails:
            t.count += 1

    @staticmethod
    def close_each(
        tails: Sequence[CompressorTail], kv: torch.Tensor, score: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Complete each tail's group with its last row ``kv[b]``/``score[b]`` ([B, dim]) and clear the tails:
        ``(kv, score)`` [B·r, dim], request b's r rows (its ``count`` open rows, then row b) at ``[b·r, b·r + r)``,
        what concatenating ``cat([tail.kv[:count], kv[b : b + 1]])`` over the tails gives.

        Several tails holding r − 1 open rows of r (``count + 1 == rows``, V4.1's tails), all alike (rows, dim,
        dtype, device), are stacked at once; otherwise each tail's rows are concatenated and it is cleared.

        Raises:
            ValueError: ``len(tails) != B``, a tail has no open row left for the last row, or rows whose width or
                dtype differ from a tail's (before any change).
        """
        if len(tails) != kv.shape[0] or len(tails) != score.shape[0]:
            raise ValueError(f"{len(tails)} tails for {kv.shape[0]} kv and {score.shape[0]} score rows")
        if any(t.count >= t.kv.shape[0] for t in tails):
            raise ValueError("a compressor tail is full: its group cannot take another row")
        _check_rows(tails, kv, score)
        first = tails[0].kv if tails else None
        # the rows' dtype and device fit every tail's (checked above); one tail: its own concatenation is as fast
        if (
            len(tails) > 1
            and kv.dtype == score.dtype
            and kv.device == score.device
            and all(
                t.count + 1 == t.kv.shape[0] and t.kv.shape == t.score.shape == first.shape for t in tails
            )
        ):
            kvs, scores = [t.kv for t in tails], [t.score for t in tails]
            group_kv, group_score = torch.stack(kvs), torch.stack(scores)  # [B, r, dim]
            group_kv[:, -1], group_score[:, -1] = kv, score
            torch._foreach_zero_(kvs)
            torch._foreach_copy_(scores, [torch.full_like(first, float("-inf"))] * len(tails))
            for t in tails:
                t.count = 0
            return group_kv.flatten(0, 1), group_score.flatten(0, 1)
        group_kv = [torch.cat([t.kv[: t.count], kv[b : b + 1]]) for b, t in enumerate(tails)]
        group_score = [torch.cat([t.score[: t.count], score[b : b + 1]]) for b, t in enumerate(tails)]
        for t in tails:  # every group built first: a failed concatenation clears no tail
            t.clear()
        if len(tails) == 1:  # its own concatenation (a new tensor) is the result
            return group_kv[0], group_score[0]
        return torch.cat(group_kv), torch.cat(group_score)


def _check_rows(tails: Sequence[CompressorTail], kv: torch.Tensor, score: torch.Tensor) -> None:
    """Raise ValueError unless each tail's rows take ``kv``/``score``'s rows ([B, dim]) as they are: the same
    width and dtype on the same device."""
    for t in tails:
        for name, rows, mine in (("kv", kv, t.kv), ("score", score, t.score)):
            if rows.shape[1:] != mine.shape[1:] or rows.dtype != mine.dtype or rows.device != mine.device:
                raise ValueError(
                    f"{name} rows {tuple(rows.shape[1:])} {rows.dtype} on {rows.device} do not fit a tail's "
                    f"{tuple(mine.shape[1:])} {mine.dtype} on {mine.device}"
                )
