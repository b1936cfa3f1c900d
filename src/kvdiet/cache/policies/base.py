"""`SwaPolicy`: what every SWA policy answers (DESIGN.md §5), and `Capture`, what to do with window state.

A policy is an immutable value; subclasses (one per file in this package) set the class attributes and
override the calls whose answer differs. Torch-free: storing and restoring window state is the tiers' job,
driven by `kvdiet.cache.control.ControlPlane` from these answers for the engine and the simulator alike.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import ClassVar

from kvdiet.cache.plan import COLD, RestorePlan, WindowSource, exact_recompute_start
from kvdiet.cache.spec import CacheSpec

__all__ = ["Capture", "SwaPolicy", "recompute_plan"]


class Capture(enum.Enum):
    """What to do with the window state reached at a block boundary (`SwaPolicy.capture_at`)."""

    NOW = "now"
    """Store it at once."""
    AT_FINISH = "at-finish"
    """Keep it (replacing an earlier one) and store it when the request finishes: the output's end."""


class SwaPolicy:
    """One SWA policy (see the package docstring for the five).

    Attributes:
        name: the ``--swa-policy`` name.
        store: where the window state this policy keeps lives (`WindowSource.SWA_POOL`,
            `WindowSource.PERSISTENT` for snapshots, `WindowSource.WINDOW_BLOCKS` for every token's
            entries), or None when it keeps none.
        exact: whether a hit continues exactly as a cold run (bounded replay is exact only on a pool hit).
        decoder_replay: whether decoder-side replay (decoder layers on the last W rows only) may run; False
            when the policy stores every token's window entries, which needs every row computed.
        stores_boundaries: whether it stores the window state at the prompt's and the output's end.
        checkpoint_every: K in tokens for ``checkpoint:K``, else None.
    """

    name: ClassVar[str]
    store: ClassVar[WindowSource | None] = None
    exact: ClassVar[bool] = True
    decoder_replay: ClassVar[bool] = True
    stores_boundaries: ClassVar[bool] = False
    checkpoint_every: int | None = None

    @classmethod
    def from_argument(cls, text: str, arg: str) -> SwaPolicy:
        """The policy for ``text`` whose part after the colon is ``arg``.

        Raises:
            ValueError: an argument this policy does not take.
        """
        if arg:
            raise ValueError(f"SWA policy {cls.name!r} takes no argument, got {text!r}")
        return cls()

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"SwaPolicy({str(self)!r})"

    def checkpoints(self, end: int) -> range:
        """Positions ``≤ end`` (tokens) where the policy stores window state whatever the request's
        boundaries are (``checkpoint:K``: every multiple of K); empty for the others."""
        return range(0)

    def capture_at(self, pos: int, *, prompt_boundary: int) -> Capture | None:
        """What to do with the window state at block boundary ``pos`` (tokens) of a request whose prompt's
        last full-block boundary is ``prompt_boundary``; None: nothing (the default: no snapshots)."""
        return None

    def capture_candidates(self, lo: int, hi: int, *, block_size: int, prompt_boundary: int) -> range:
        """The block boundaries in ``[lo, hi]`` (``lo`` a multiple of ``block_size``) where `capture_at` may
        answer something other than None, ascending: what a forward's end checks (default: none)."""
        return range(0)

    def plan(
        self,
        hit_tokens: int,
        *,
        window: int,
        num_layers: int,
        align: int,
        has_snapshot: Callable[[int], bool],
    ) -> RestorePlan:
        """The restore plan for a global-KV hit; the default restores the window state at H from ``store``
        when it holds some, else recomputes the exact dependency window.

        Args:
            hit_tokens: H, tokens of global KV found (a multiple of the block size; 0 = miss).
            window: W (config ``sliding_window``).
            num_layers: layers with a window (all of them).
            align: replay starts are multiples of this (lcm of the compress ratios).
            has_snapshot: whether ``store`` holds window state at a position (tokens).
        """
        h = hit_tokens
        if self.store is not None and h > 0 and has_snapshot(h):
            return RestorePlan(h, h, self.store, h)
        return recompute_plan(h, window, num_layers, align)

    def persisted_snapshots(self, num_tokens: int, *, boundaries: Sequence[int]) -> Sequence[int]:
        """Positions (tokens) of the window snapshots kept in the persistent tier for a session of
        ``num_tokens`` tokens whose prompt/output ends are at ``boundaries`` (the default: its `checkpoints`,
        none but ``checkpoint:K``'s)."""
        return self.checkpoints(num_tokens)

    def persistent_window_bytes(self, spec: CacheSpec, num_tokens: int, *, boundaries: Sequence[int]) -> int:
        """Window bytes kept in the persistent tier for a session of ``num_tokens`` tokens whose prompt/output
        ends are at ``boundaries`` (tokens): each snapshot of `persisted_snapshots` at the bytes the engine
        writes at its position (`CacheSpec.snapshots_bytes`, what the trace study counts too)."""
        return spec.snapshots_bytes(self.persisted_snapshots(num_tokens, boundaries=boundaries))

    def persistent_bytes(self, spec: CacheSpec, num_tokens: int, *, boundaries: Sequence[int]) -> int:
        """Bytes kept in the persistent tier for a session of ``num_tokens`` tokens whose prompt/output ends
        are at ``boundaries`` (tokens): global KV plus what the policy keeps of the window."""
        return spec.global_bytes(num_tokens) + self.persistent_window_bytes(
            spec, num_tokens, boundaries=boundaries
        )

    def worst_recompute(self, window: int, num_layers: int) -> int:
        """Tokens recomputed at a hit when nothing closer is stored (the default: the exact receptive field
        of ``num_layers`` window layers, W + (L−1)(W−1), vLLM PR #57281)."""
        return window + (num_layers - 1) * (window - 1)

    def recompute_tokens(self, spec: CacheSpec, hit_tokens: int) -> int:
        """Tokens recomputed to rebuild the window state at a hit of ``hit_tokens`` when nothing closer is
        stored (worst case: a checkpoint just missed, a miss of the SWA pool).

        bounded-replay: W (v41-spec §7.2); checkpoint:K: up to K−1 (never more than exact-recompute);
        exact-recompute: the receptive field of L window layers, W + (L−1)(W−1) (vLLM PR #57281);
        stored-snapshot policies: 0 at their boundaries.
        """
        if not spec.windows:
            return 0
        return min(self.worst_recompute(spec.windows[0].window, len(spec.windows)), hit_tokens)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.checkpoint_every == self.checkpoint_every

    def __hash__(self) -> int:
        return hash((type(self), self.checkpoint_every))


def recompute_plan(hit_tokens: int, window: int, num_layers: int, align: int) -> RestorePlan:
    """Recompute the exact dependency window of a hit (`exact_recompute_start`); cold when it starts at 0."""
    start = exact_recompute_start(hit_tokens, window, num_layers, align)
    return COLD if start == 0 else RestorePlan(hit_tokens, None, None, start)


class BoundaryCapture(SwaPolicy):
    """Captures the window state at the prompt's last full block boundary (stored at once) and at the latest
    boundary reached past it (stored when the request finishes): the base of the boundary policies."""

    stores_boundaries = True

    def capture_at(self, pos: int, *, prompt_boundary: int) -> Capture | None:
        if pos < prompt_boundary:
            return None  # a prefill chunk's end inside the prompt: neither the prompt's nor the output's end
        return Capture.NOW if pos == prompt_boundary else Capture.AT_FINISH

    def capture_candidates(self, lo: int, hi: int, *, block_size: int, prompt_boundary: int) -> range:
        return range(max(lo, prompt_boundary), hi + 1, block_size)
