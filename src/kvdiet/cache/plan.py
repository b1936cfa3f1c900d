"""What the control plane hands its executors: restore plans, actions and the provenance record (DESIGN.md §5).

Plain data, no tensors. Given the global-KV hit ``H`` (tokens, a block multiple) and which stored window
states exist, each policy's `kvdiet.cache.policies.SwaPolicy.plan` gives a `RestorePlan`: which global KV to
adopt, which window state to load and which tokens to recompute. `kvdiet.cache.control.ControlPlane` turns
lookups into plans and plans into window actions (`RestoreWindow`, `Replay`); the engine's
runner executes them with tensors, the simulator with byte sizes. `Provenance` is what both report per request.

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
from collections.abc import Hashable
from dataclasses import asdict, dataclass, fields
from operator import attrgetter
from typing import Any

__all__ = [
    "COLD",
    "Provenance",
    "Replay",
    "RestorePlan",
    "RestoreWindow",
    "WindowSource",
    "exact_recompute_start",
]


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


@dataclass(frozen=True, slots=True)
class RestoreWindow:
    """Restore the window state at position ``at`` (tokens) from ``source``.

    Attributes:
        at: the position the stored state belongs to.
        source: `WindowSource.SWA_POOL` / `WindowSource.PERSISTENT` (one snapshot) or
            `WindowSource.WINDOW_BLOCKS` (the window entries of blocks ``[max(0, at − W) // B, at // B)``).
        keys: the tier keys read, in block order.
        payloads: what the tier returned for each key (bytes, or sizes in the simulator).
    """

    at: int
    source: WindowSource
    keys: tuple[Hashable, ...]
    payloads: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Replay:
    """Recompute positions ``[start, end)`` (tokens) to rebuild window state; global KV there is kept.

    Attributes:
        clipped: the replay's windows read nothing below ``start`` (bounded replay: approximate).
    """

    start: int
    end: int
    clipped: bool


@dataclass(frozen=True, slots=True)
class Provenance:
    """Where a prompt's tokens came from: the per-request record of the engine and the simulator alike.

    Attributes:
        prompt_tokens: N.
        device_tokens / global_pool_tokens / persistent_tokens: global KV taken from the device pool / loaded
            from the shared global-KV DRAM tier / loaded from the persistent tier (tokens; block multiples;
            together the hit H).
        window_source: where the window state at H came from (`WindowSource`).
        window_tokens: tokens whose window state was restored from ``window_source`` (0 for replay/cold).
        replayed_tokens: tokens recomputed below H to rebuild window state (global KV not rewritten).
        computed_tokens: tokens ``[H, N)`` prefilled as usual.
        exact: whether the continuation equals a cold run (False for a bounded replay).
    """

    prompt_tokens: int
    device_tokens: int
    global_pool_tokens: int
    persistent_tokens: int
    window_source: WindowSource
    window_tokens: int
    replayed_tokens: int
    computed_tokens: int
    exact: bool

    @classmethod
    def of(
        cls,
        plan: RestorePlan,
        *,
        prompt_tokens: int,
        device_tokens: int,
        global_pool_tokens: int = 0,
        window: int,
    ) -> Provenance:
        """The record of a request of ``prompt_tokens`` whose device-pool hit was ``device_tokens``, whose
        global-pool loads continued it by ``global_pool_tokens`` (the rest of the hit came from the persistent
        tier) and whose restore plan is ``plan``; ``window`` is W (tokens). A plan that adopts less than was
        found keeps the upper tiers' share first."""
        hit = plan.hit_tokens
        device = min(device_tokens, hit)
        pooled = min(global_pool_tokens, hit - device)
        source = plan.snapshot_source or (WindowSource.REPLAY if hit else WindowSource.NONE)
        return cls(
            prompt_tokens=prompt_tokens,
            device_tokens=device,
            global_pool_tokens=pooled,
            persistent_tokens=hit - device - pooled,
            window_source=source,
            window_tokens=min(window, plan.snapshot_at or 0) if plan.snapshot_source else 0,
            replayed_tokens=plan.replay_tokens,
            computed_tokens=prompt_tokens - hit,
            exact=not plan.clipped,
        )

    @property
    def hit_tokens(self) -> int:
        return self.device_tokens + self.global_pool_tokens + self.persistent_tokens

    def as_dict(self) -> dict[str, object]:
        return asdict(self) | {"hit_tokens": self.hit_tokens}

    def __reduce__(self) -> tuple[type[Provenance], tuple]:
        """Pickled as the constructor's arguments (a study's processes send one per request: faster than the
        dataclass default)."""
        return Provenance, _provenance_fields(self)


_provenance_fields = attrgetter(*(f.name for f in fields(Provenance)))
