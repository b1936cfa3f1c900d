"""``checkpoint:K``: one window snapshot every K tokens, persisted; a hit recomputes from the latest one."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from kvdiet.cache.plan import COLD, RestorePlan, WindowSource, exact_recompute_start
from kvdiet.cache.policies.base import Capture, SwaPolicy, recompute_plan

__all__ = ["Checkpoint"]


@dataclass(frozen=True, slots=True, eq=False)
class Checkpoint(SwaPolicy):
    """``checkpoint:K``: one window snapshot every K tokens in the persistent tier; a hit at H restores the
    latest checkpoint C ≤ H and recomputes ``[C, H)`` — unless the exact recompute's start E (the receptive
    field of the window layers) is at or past C: then it recomputes ``[E, H)`` and reads no snapshot.

    Attributes:
        checkpoint_every: K in tokens (> 0).
    """

    checkpoint_every: int
    name: ClassVar[str] = "checkpoint"
    store: ClassVar[WindowSource | None] = WindowSource.PERSISTENT

    @classmethod
    def from_argument(cls, text: str, arg: str) -> SwaPolicy:
        if not arg.isdigit() or int(arg) <= 0:
            raise ValueError(
                f"SWA policy {text!r}: checkpoint needs a period K > 0 in tokens, e.g. checkpoint:4096"
            )
        return cls(int(arg))

    def __str__(self) -> str:
        return f"checkpoint:{self.checkpoint_every}"

    def checkpoints(self, end: int) -> range:
        return range(self.checkpoint_every, end + 1, self.checkpoint_every)

    def capture_at(self, pos: int, *, prompt_boundary: int) -> Capture | None:
        return None if pos % self.checkpoint_every else Capture.NOW

    def capture_candidates(self, lo: int, hi: int, *, block_size: int, prompt_boundary: int) -> range:
        step = math.lcm(self.checkpoint_every, block_size)  # block boundaries that are checkpoints
        return range(-(-lo // step) * step, hi + 1, step)

    def plan(
        self,
        hit_tokens: int,
        *,
        window: int,
        num_layers: int,
        align: int,
        has_snapshot: Callable[[int], bool],
    ) -> RestorePlan:
        h = hit_tokens
        if h <= 0:
            return COLD
        c = h - h % self.checkpoint_every
        if c > exact_recompute_start(h, window, num_layers, align) and has_snapshot(c):
            return RestorePlan(h, c, WindowSource.PERSISTENT, c)
        return recompute_plan(h, window, num_layers, align)  # replaying from the later start costs less

    def worst_recompute(self, window: int, num_layers: int) -> int:
        return min(self.checkpoint_every - 1, SwaPolicy.worst_recompute(self, window, num_layers))
