"""SWA policies: what is kept of the window state at a prefix boundary, where, and what that costs.

DESIGN.md §5. Each policy is one small class behind the `SwaPolicy` base: where its window state is stored
(`SwaPolicy.store`), when it captures it (`SwaPolicy.capture_at`, `SwaPolicy.checkpoints`), how a hit is
planned (`SwaPolicy.plan`), the bytes it persists and the tokens it recomputes. `SwaPolicy.parse` is the
registry: it maps a ``--swa-policy`` name to its class and nothing else. Torch-free; storing and restoring
window state is the tiers' job, executed by the engine (`kvdiet.engine.kv_cache`) and the simulator
(`kvdiet.sim.model_free`) from the same answers.

| policy | persisted beside the global KV | on a hit at H |
|---|---|---|
| ``bounded-replay`` (V4.1) | nothing (snapshots only in the short-TTL pool) | pool hit: restore; miss: replay last W |
| ``boundary-snapshot`` (V4 deployment) | one window snapshot per prompt/output end | restore at a stored boundary |
| ``full-store`` | every token's window entries | restore at any block boundary |
| ``checkpoint:K`` | one window snapshot every K tokens | restore latest checkpoint ≤ H, recompute from it |
| ``exact-recompute`` | nothing | recompute the whole dependency window |

Snapshot bytes here are the window rings (what DeepSeek and vLLM call the SWA cache); compressor-tail
rows are reported separately by `kvdiet.cache.spec.CacheSpec.tail_bytes_per_request`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from kvdiet.cache.manager import COLD, RestorePlan, WindowSource, exact_recompute_start
from kvdiet.cache.spec import CacheSpec

__all__ = [
    "POLICY_NAMES",
    "BoundarySnapshot",
    "BoundedReplay",
    "Capture",
    "Checkpoint",
    "ExactRecompute",
    "FullStore",
    "SwaPolicy",
]


class Capture(enum.Enum):
    """What to do with the window state reached at a block boundary (`SwaPolicy.capture_at`)."""

    NOW = "now"
    """Store it at once."""
    AT_FINISH = "at-finish"
    """Keep it (replacing an earlier one) and store it when the request finishes: the output's end."""


class SwaPolicy:
    """One SWA policy. Instances are immutable values; subclasses set the class attributes and override
    the calls whose answer differs.

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

    @staticmethod
    def parse(text: str) -> SwaPolicy:
        """Parse ``bounded-replay``, ``boundary-snapshot``, ``full-store``, ``checkpoint:K``, ``exact-recompute``.

        Raises:
            ValueError: unknown name, or ``checkpoint`` without a positive integer K.
        """
        name, _, arg = text.partition(":")
        cls = _REGISTRY.get(name)
        if cls is None:
            raise ValueError(
                f"unknown SWA policy {text!r}; choose one of bounded-replay, boundary-snapshot, "
                f"full-store, checkpoint:K, exact-recompute"
            )
        return cls.from_argument(text, arg)

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
        return _recompute(h, window, num_layers, align)

    def persistent_window_bytes(self, spec: CacheSpec, num_tokens: int, *, boundaries: int) -> int:
        """Window bytes kept in the persistent tier for a session of ``num_tokens`` tokens with
        ``boundaries`` prompt/output ends (the default: none)."""
        return 0

    def persistent_bytes(self, spec: CacheSpec, num_tokens: int, *, boundaries: int) -> int:
        """Bytes kept in the persistent tier for a session of ``num_tokens`` tokens with ``boundaries``
        prompt/output ends (global KV plus what the policy keeps of the window)."""
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

        bounded-replay: W (v41-spec §7.2); checkpoint:K: up to K−1; exact-recompute: the receptive field of
        L window layers, W + (L−1)(W−1) (vLLM PR #57281); stored-snapshot policies: 0 at their boundaries.
        """
        if not spec.windows:
            return 0
        return min(self.worst_recompute(spec.windows[0].window, len(spec.windows)), hit_tokens)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.checkpoint_every == self.checkpoint_every

    def __hash__(self) -> int:
        return hash((type(self), self.checkpoint_every))


def _recompute(h: int, window: int, num_layers: int, align: int) -> RestorePlan:
    start = exact_recompute_start(h, window, num_layers, align)
    return COLD if start == 0 else RestorePlan(h, None, None, start)


class _BoundaryPolicy(SwaPolicy):
    """Stores the window state at the prompt's last full block boundary (at once) and at the latest
    boundary reached past it (when the request finishes)."""

    stores_boundaries = True

    def capture_at(self, pos: int, *, prompt_boundary: int) -> Capture | None:
        if pos < prompt_boundary:
            return None  # a prefill chunk's end inside the prompt: neither the prompt's nor the output's end
        return Capture.NOW if pos == prompt_boundary else Capture.AT_FINISH


class BoundedReplay(_BoundaryPolicy):
    """V4.1: snapshots only in the short-TTL SWA pool; on a pool miss, replay the last W tokens (approximate:
    the replayed windows read nothing below the replay start). A hit of ≤ W tokens is not adopted."""

    name = "bounded-replay"
    store = WindowSource.SWA_POOL
    exact = False

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
        if has_snapshot(h):
            return RestorePlan(h, h, WindowSource.SWA_POOL, h)
        if h <= window:
            return COLD
        start = h - window
        start -= start % align
        return COLD if start == 0 else RestorePlan(h, None, None, start, clipped=True)

    def worst_recompute(self, window: int, num_layers: int) -> int:
        return window


class BoundarySnapshot(_BoundaryPolicy):
    """V4 deployment: one window snapshot per prompt/output end, in the persistent tier."""

    name = "boundary-snapshot"
    store = WindowSource.PERSISTENT

    def persistent_window_bytes(self, spec: CacheSpec, num_tokens: int, *, boundaries: int) -> int:
        return boundaries * spec.window_bytes_per_request

    def worst_recompute(self, window: int, num_layers: int) -> int:
        return 0


class FullStore(SwaPolicy):
    """Every token's window entries, one payload per block in the persistent tier: restore at any block
    boundary. Decoder-side replay is off (every row's entries are kept)."""

    name = "full-store"
    store = WindowSource.WINDOW_BLOCKS
    decoder_replay = False

    def persistent_window_bytes(self, spec: CacheSpec, num_tokens: int, *, boundaries: int) -> int:
        return num_tokens * spec.window_entry_bytes_per_token

    def worst_recompute(self, window: int, num_layers: int) -> int:
        return 0


@dataclass(frozen=True, slots=True, eq=False)
class Checkpoint(SwaPolicy):
    """``checkpoint:K``: one window snapshot every K tokens in the persistent tier; a hit at H restores the
    latest checkpoint C ≤ H and recomputes ``[C, H)``.

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
        if c > 0 and has_snapshot(c):
            return RestorePlan(h, c, WindowSource.PERSISTENT, c)
        return _recompute(h, window, num_layers, align)

    def persistent_window_bytes(self, spec: CacheSpec, num_tokens: int, *, boundaries: int) -> int:
        return (num_tokens // self.checkpoint_every) * spec.window_bytes_per_request

    def worst_recompute(self, window: int, num_layers: int) -> int:
        return self.checkpoint_every - 1


class ExactRecompute(SwaPolicy):
    """Stores no window state: a hit recomputes the whole dependency window."""

    name = "exact-recompute"


_REGISTRY: dict[str, type[SwaPolicy]] = {
    cls.name: cls for cls in (BoundedReplay, BoundarySnapshot, FullStore, Checkpoint, ExactRecompute)
}
POLICY_NAMES = tuple(_REGISTRY)
