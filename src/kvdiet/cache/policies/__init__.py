"""SWA policies: what is kept of the window state at a prefix boundary, where, and what that costs.

DESIGN.md §5. One class per file behind `SwaPolicy` (`base.py`): where its window state is stored
(`SwaPolicy.store`), when it captures it (`SwaPolicy.capture_at`, `SwaPolicy.checkpoints`), how a hit is
planned (`SwaPolicy.plan`), the bytes it persists and the tokens it recomputes. `parse_policy` is the
registry: it maps a ``--swa-policy`` name to its class and nothing else; nothing downstream compares names.

| policy | persisted beside the global KV | on a hit at H |
|---|---|---|
| ``bounded-replay`` (V4.1) | nothing (snapshots only in the short-TTL pool) | pool hit: restore; miss: replay last W |
| ``boundary-snapshot`` (V4 deployment) | one window snapshot per prompt/output end | restore at a stored boundary |
| ``full-store`` | every token's window entries | restore at any block boundary |
| ``checkpoint:K`` | one window snapshot every K tokens | restore latest checkpoint ≤ H, recompute from it |
| ``exact-recompute`` | nothing | recompute the whole dependency window |

A persisted snapshot counts the bytes the engine writes at its position (`SwaPolicy.persistent_window_bytes`
over `SwaPolicy.persisted_snapshots`, each `kvdiet.cache.spec.CacheSpec.snapshot_bytes`): the window rings
(what DeepSeek and vLLM call the SWA cache) with their positions, the compressor tails' held rows, the Engram
history and the frame — what the trace study counts too.
"""

from __future__ import annotations

from kvdiet.cache.policies.base import Capture, SwaPolicy
from kvdiet.cache.policies.boundary_snapshot import BoundarySnapshot
from kvdiet.cache.policies.bounded_replay import BoundedReplay
from kvdiet.cache.policies.checkpoint import Checkpoint
from kvdiet.cache.policies.exact_recompute import ExactRecompute
from kvdiet.cache.policies.full_store import FullStore

__all__ = [
    "POLICY_NAMES",
    "BoundarySnapshot",
    "BoundedReplay",
    "Capture",
    "Checkpoint",
    "ExactRecompute",
    "FullStore",
    "SwaPolicy",
    "parse_policy",
]

_REGISTRY: dict[str, type[SwaPolicy]] = {
    cls.name: cls for cls in (BoundedReplay, BoundarySnapshot, FullStore, Checkpoint, ExactRecompute)
}
POLICY_NAMES = tuple(_REGISTRY)
"""The ``--swa-policy`` names (``checkpoint`` takes ``:K``)."""


def parse_policy(text: str) -> SwaPolicy:
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
