"""Where a prefix hit's window state comes from: the restore plan of each SWA policy (DESIGN.md §5).

Control plane only. Given the global-KV hit ``H`` (tokens, a block multiple) and which stored window states
exist, each policy's `kvdiet.cache.policy.SwaPolicy.plan` says which global KV to adopt,
which window snapshot to load and which tokens to recompute. The runner (`kvdiet.engine.kv_cache`) executes the plan.

| policy | window state at H | fallback |
|---|---|---|
| ``bounded-replay`` | SWA-pool snapshot at H | replay ``[H−W, H)``; a hit of ≤ W tokens is not adopted |
| ``boundary-snapshot`` | persisted snapshot at H | exact recompute |
| ``full-store`` | persisted window entries of ``[H−W, H)`` | exact recompute |
| ``checkpoint:K`` | latest persisted snapshot at C ≤ H (C a multiple of K); recompute ``[C, H)`` | exact recompute |
| ``exact-recompute`` | — | recompute ``[H − W − (L−1)(W−1), H)`` (the receptive field of L window layers) |

Replay starts are aligned down to ``align`` (the lcm of the compress ratios) so no compression group is
split; a plan whose recompute would start at 0 adopts nothing (a cold prefill costs the same).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

__all__ = ["COLD", "KeyKind", "RestorePlan", "WindowSource", "exact_recompute_start"]


class KeyKind(enum.StrEnum):
    """What a tier key names, beside the block hash it derives from: one vocabulary for the engine's derived
    keys (``blake2b(hash, person=b"kvdiet-" + kind)``) and the simulator's ``(kind, block)`` keys."""

    BLOCK = "kv"
    """A block's global KV (the engine keys it by the block hash itself)."""
    SNAPSHOT = "snap"
    """A window snapshot in the persistent tier (boundary-snapshot, checkpoint:K)."""
    POOL_SNAPSHOT = "swa"
    """A window snapshot in the SWA pool (bounded-replay)."""
    WINDOW_BLOCK = "win"
    """A block's window entries (full-store)."""

    @classmethod
    def snapshot_in(cls, store: WindowSource | None) -> KeyKind:
        """The kind of a window snapshot kept in ``store`` (a policy's `SwaPolicy.store`)."""
        return cls.POOL_SNAPSHOT if store is WindowSource.SWA_POOL else cls.SNAPSHOT


class WindowSource(enum.StrEnum):
    """Where a request's window state came from, and where a policy keeps it: one vocabulary for the
    engine, the simulator and their reports (the values are the names in JSON and ``/v1`` provenance)."""

    SWA_POOL = "swa-pool"
    """A snapshot in the SWA pool (bounded-replay)."""
    PERSISTENT = "persistent"
    """A snapshot stored in the persistent tier (boundary-snapshot, checkpoint:K)."""
    WINDOW_BLOCKS = "window-blocks"
    """Every token's window entries, one payload per block in the persistent tier (full-store)."""
    REPLAY = "replay"
    """Recomputed from the plan's replay start (nothing restored)."""
    NONE = "none"
    """A cold prefill: no hit adopted."""


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """What to do with a global-KV hit.

    Attributes:
        hit_tokens: global KV adopted, in tokens (0: cold prefill).
        snapshot_at: position of the window state to load (None: nothing loaded).
        snapshot_source: `WindowSource.SWA_POOL`, `WindowSource.PERSISTENT` (a stored snapshot) or
            `WindowSource.WINDOW_BLOCKS` (full-store entries), or None.
        replay_start: first position recomputed; ``hit_tokens − replay_start`` tokens are replayed.
        clipped: the replay's windows read nothing below ``replay_start`` although the exact state would
            (bounded replay: approximate); False for every exact plan.
    """

    hit_tokens: int
    snapshot_at: int | None
    snapshot_source: WindowSource | None
    replay_start: int
    clipped: bool = False

    @property
    def replay_tokens(self) -> int:
        return self.hit_tokens - self.replay_start


COLD = RestorePlan(0, None, None, 0)


def exact_recompute_start(hit_tokens: int, window: int, num_layers: int, align: int) -> int:
    """``H − (W + (L−1)(W−1))`` aligned down to ``align``, clamped at 0 (vLLM PR #57281's exact window)."""
    start = max(0, hit_tokens - (window + (num_layers - 1) * (window - 1)))
    return start - start % align
