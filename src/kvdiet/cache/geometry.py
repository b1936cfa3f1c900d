"""`Geometry`: the sizes the cache rules need (`kvdiet.cache.control.ControlPlane`), in tokens and bytes, from a
model config's packed cache formats (`kvdiet.cache.spec.CacheSpec`); and `prompt_boundary`. Plain data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import cycle, islice

from kvdiet.cache.spec import CacheSpec
from kvdiet.config import ModelConfig
from kvdiet.layer_plan import LayerPlan

__all__ = ["Geometry", "prompt_boundary"]


def prompt_boundary(prompt_tokens: int, block_size: int) -> int:
    """The prompt's last full-block boundary that leaves its last token to compute: ``(N − 1) // B × B``."""
    return (prompt_tokens - 1) // block_size * block_size


@dataclass(frozen=True, slots=True)
class Geometry:
    """The sizes the rules need (tokens and bytes).

    Attributes:
        block_size: tokens per block (B).
        window: sliding window W (tokens).
        num_layers: layers with a window ring.
        align: replay starts are multiples of this (lcm of the compress ratios of the KV sources).
        block_bytes: one block's global KV payload (bytes); the mean over `block_cycle` when blocks differ.
        window_block_bytes: one block's window entries of every layer (``full-store`` payload, bytes).
        block_cycle: the payload of blocks ``0, 1, …`` repeating, when a compress ratio does not divide the
            block size (V4-Flash's HCA, ratio 128, at 64-token blocks: an entry spans two blocks and is counted
            in the block where its group completes); empty when every block holds ``block_bytes``.
    """

    block_size: int
    window: int
    num_layers: int
    align: int
    block_bytes: int
    window_block_bytes: int
    block_cycle: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, cfg: ModelConfig, block_size: int) -> Geometry:
        """The geometry of the packed cache formats of ``cfg`` (`CacheSpec`) at ``block_size``: block i holds
        the entries whose compression group completes in it, ``global_bytes((i + 1)·B) − global_bytes(i·B)``.

        Raises:
            ValueError: ``block_size`` < 1.
        """
        if block_size < 1:
            raise ValueError(f"block size must be >= 1 token, got {block_size}")
        spec, plan = CacheSpec.from_config(cfg), LayerPlan.from_config(cfg)
        period = math.lcm(block_size, plan.block_unit) // block_size  # blocks after which the layout repeats
        sizes = tuple(
            spec.global_bytes((i + 1) * block_size) - spec.global_bytes(i * block_size) for i in range(period)
        )
        return cls(
            block_size=block_size,
            window=cfg.sliding_window,
            num_layers=len(plan.layers),
            align=plan.block_unit,
            block_bytes=round(sum(sizes) / period),
            window_block_bytes=block_size * spec.window_entry_bytes_per_token,
            block_cycle=sizes if len(set(sizes)) > 1 else (),
        )

    def payload_bytes(self, block: int) -> int:
        """Global KV bytes of block ``block`` (0-based) of a request."""
        return self.block_cycle[block % len(self.block_cycle)] if self.block_cycle else self.block_bytes

    def payloads(self, first: int, end: int) -> list[int]:
        """`payload_bytes` of blocks ``[first, end)``."""
        if not self.block_cycle:
            return [self.block_bytes] * max(0, end - first)
        start = first % len(self.block_cycle)
        return list(islice(cycle(self.block_cycle), start, start + max(0, end - first)))
