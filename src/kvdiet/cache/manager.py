"""Where a prefix hit's window state comes from: the restore plan of each SWA policy (DESIGN.md §5).

Control plane only. Given the global-KV hit ``H`` (tokens, a block multiple) and which stored window states
exist, `plan_restore` says which global KV to adopt, which window snapshot to load and which tokens to
recompute. The runner (`kvdiet.engine.kv_cache`) executes the plan.

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

from collections.abc import Callable
from dataclasses import dataclass

from kvdiet.cache.policy import SwaPolicy

__all__ = ["RestorePlan", "exact_recompute_start", "plan_restore"]


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """What to do with a global-KV hit.

    Attributes:
        hit_tokens: global KV adopted, in tokens (0: cold prefill).
        snapshot_at: position of the window state to load (None: nothing loaded).
        snapshot_source: ``"swa-pool"``, ``"persistent"`` (a stored snapshot) or ``"window-blocks"``
            (full-store entries), or None.
        replay_start: first position recomputed; ``hit_tokens − replay_start`` tokens are replayed.
        clipped: the replay's windows read nothing below ``replay_start`` although the exact state would
            (bounded replay: approximate); False for every exact plan.
    """

    hit_tokens: int
    snapshot_at: int | None
    snapshot_source: str | None
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


def plan_restore(
    policy: SwaPolicy,
    hit_tokens: int,
    *,
    window: int,
    num_layers: int,
    align: int,
    has_snapshot: Callable[[int], bool],
) -> RestorePlan:
    """The restore plan for a global-KV hit of ``hit_tokens`` under ``policy``.

    Args:
        policy: the SWA policy.
        hit_tokens: H, tokens of global KV found (a multiple of the block size; 0 = miss).
        window: W (config ``sliding_window``).
        num_layers: layers with a window (all of them).
        align: replay starts are multiples of this (lcm of the compress ratios).
        has_snapshot: whether the policy's store holds window state at a position (the SWA pool for
            bounded-replay, persisted snapshots or window blocks for the others).
    """
    h = hit_tokens
    if h <= 0:
        return COLD
    name = policy.name
    if name == "bounded-replay":
        if has_snapshot(h):
            return RestorePlan(h, h, "swa-pool", h)
        if h <= window:
            return COLD
        start = h - window
        start -= start % align
        return COLD if start == 0 else RestorePlan(h, None, None, start, clipped=True)
    if name in ("boundary-snapshot", "full-store") and has_snapshot(h):
        return RestorePlan(h, h, "window-blocks" if name == "full-store" else "persistent", h)
    if name == "checkpoint":
        k = policy.checkpoint_every or 0
        c = h - h % k
        if c > 0 and has_snapshot(c):
            return RestorePlan(h, c, "persistent", c)
    start = exact_recompute_start(h, window, num_layers, align)
    return COLD if start == 0 else RestorePlan(h, None, None, start)
