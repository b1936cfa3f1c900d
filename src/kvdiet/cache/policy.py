"""SWA policies: what is kept of the window state at a prefix boundary, and what that costs.

DESIGN.md §5. A policy is a name plus, for ``checkpoint:K``, a period. This module only parses policies
and counts bytes and tokens (torch-free); storing and restoring window state is the tiers' job.

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

from dataclasses import dataclass

from kvdiet.cache.spec import CacheSpec

__all__ = ["POLICY_NAMES", "SwaPolicy"]

POLICY_NAMES = ("bounded-replay", "boundary-snapshot", "full-store", "checkpoint", "exact-recompute")


@dataclass(frozen=True, slots=True)
class SwaPolicy:
    """A parsed ``--swa-policy`` value.

    Attributes:
        name: one of `POLICY_NAMES`.
        checkpoint_every: K in tokens for ``checkpoint:K``, else None.
    """

    name: str
    checkpoint_every: int | None = None

    @classmethod
    def parse(cls, text: str) -> SwaPolicy:
        """Parse ``bounded-replay``, ``boundary-snapshot``, ``full-store``, ``checkpoint:K``, ``exact-recompute``.

        Raises:
            ValueError: unknown name, or ``checkpoint`` without a positive integer K.
        """
        name, _, arg = text.partition(":")
        if name not in POLICY_NAMES:
            raise ValueError(
                f"unknown SWA policy {text!r}; choose one of bounded-replay, boundary-snapshot, "
                f"full-store, checkpoint:K, exact-recompute"
            )
        if name == "checkpoint":
            if not arg.isdigit() or int(arg) <= 0:
                raise ValueError(
                    f"SWA policy {text!r}: checkpoint needs a period K > 0 in tokens, e.g. checkpoint:4096"
                )
            return cls(name, int(arg))
        if arg:
            raise ValueError(f"SWA policy {name!r} takes no argument, got {text!r}")
        return cls(name)

    def __str__(self) -> str:
        return f"checkpoint:{self.checkpoint_every}" if self.checkpoint_every else self.name

    @property
    def exact(self) -> bool:
        """Whether a hit continues exactly as a cold run (bounded replay is exact only on a pool hit)."""
        return self.name != "bounded-replay"

    def persistent_bytes(self, spec: CacheSpec, num_tokens: int, *, boundaries: int) -> int:
        """Bytes kept in the persistent tier for a session of ``num_tokens`` tokens with ``boundaries``
        prompt/output ends (global KV plus what the policy keeps of the window)."""
        window = spec.window_bytes_per_request
        extra = {
            "bounded-replay": 0,
            "exact-recompute": 0,
            "boundary-snapshot": boundaries * window,
            "full-store": num_tokens * spec.window_entry_bytes_per_token,
            "checkpoint": (num_tokens // self.checkpoint_every) * window if self.checkpoint_every else 0,
        }[self.name]
        return spec.global_bytes(num_tokens) + extra

    def recompute_tokens(self, spec: CacheSpec, hit_tokens: int) -> int:
        """Tokens recomputed to rebuild the window state at a hit of ``hit_tokens`` when nothing closer is
        stored (worst case: a checkpoint just missed, a miss of the SWA pool).

        bounded-replay: W (v41-spec §7.2); checkpoint:K: up to K−1; exact-recompute: the receptive field of
        L window layers, W + (L−1)(W−1) (vLLM PR #57281); stored-snapshot policies: 0 at their boundaries.
        """
        if not spec.windows:
            return 0
        w, layers = spec.windows[0].window, len(spec.windows)
        need = {
            "bounded-replay": w,
            "exact-recompute": w + (layers - 1) * (w - 1),
            "boundary-snapshot": 0,
            "full-store": 0,
            "checkpoint": (self.checkpoint_every or 1) - 1,
        }[self.name]
        return min(need, hit_tokens)
