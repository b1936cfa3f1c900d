"""A request's rows in one forward call (`Segment`): what the attention layers read of it and publish to later
layers during that call (v41-spec §2, §7)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvdiet.model.row_tables import RowTables
from kvdiet.model.state import RequestState

__all__ = ["Segment"]


@dataclass(slots=True)
class Segment:
    """One request's rows in a forward call, and what layers publish to later layers during that call.

    Attributes:
        state: the request's caches (mutated by the layers).
        positions: int64 [T] consecutive absolute positions of the rows.
        window_floor: window keys at positions below this are never read.
        topk: ``{index-source layer: (idx int64 [T, k], valid bool [T, k])}`` for these rows.
        candidates: the candidate source's kept blocks ``(block ids [T, Kb], valid)`` for these rows.
        decoded_main: per-call decoded copies of a KV source's main-KV entries (read-only).
        tables: what the layers compute alike from these rows (`RowTables`; a narrowed segment starts anew).
    """

    state: RequestState
    positions: torch.Tensor
    window_floor: int = 0
    topk: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    candidates: tuple[torch.Tensor, torch.Tensor] | None = None
    decoded_main: dict[int, torch.Tensor] = field(default_factory=dict)
    tables: RowTables = field(default_factory=RowTables)

    @property
    def start_pos(self) -> int:
        return int(self.positions[0])

    def last_rows(self, keep: int, window_floor: int) -> Segment:
        """The same request narrowed to its last ``keep`` rows (decoder bounded replay)."""
        cut = self.positions.shape[0] - keep
        topk = {layer: (i[cut:], v[cut:]) for layer, (i, v) in self.topk.items()}
        cand = None if self.candidates is None else (self.candidates[0][cut:], self.candidates[1][cut:])
        return Segment(
            self.state,
            self.positions[cut:],
            max(self.window_floor, window_floor),
            topk,
            cand,
            self.decoded_main,
        )
