"""``exact-recompute``: no window state stored; a hit recomputes the whole dependency window."""

from __future__ import annotations

from kvdiet.cache.policies.base import SwaPolicy

__all__ = ["ExactRecompute"]


class ExactRecompute(SwaPolicy):
    """Stores no window state: a hit at H recomputes ``[H − W − (L−1)(W−1), H)`` (the receptive field of L
    window layers, vLLM PR #57281), exactly."""

    name = "exact-recompute"
