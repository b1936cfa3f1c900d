"""The paged device pool: every KV-source layer's packed main-KV entries and index keys, in blocks.

One preallocated tensor per (KV-source layer, kind) of shape ``[num_blocks, block_size // ratio, width]``
(uint8 for packed formats, fp32 in exact mode). Block ``b`` holds, for each layer, the entries covering
tokens ``[i·block_size, (i+1)·block_size)`` of whichever request has ``b`` at index ``i`` of its block
table: a ratio-2 layer holds ``block_size / 2`` entries per block, a ratio-1 layer ``block_size``
(v41-spec §5; block size 64 by default, as vLLM's DeepSeek-V4 path). Window rings, compressor tails and
Engram history are per-request state, not pages of this pool.

The block ids come from an allocator the caller passes (``self.blocks``, a `BlockAllocator`: the cache
layer's `kvdiet.cache.block_pool.BlockPool` under an engine, which also keeps ref counts and the prefix
index); without one the pool makes its own growable `PrivateBlocks`. This class adds only the tensors and
the byte layout of one block (`block_bytes`, `read_block`, `write_block`) that the persistent tier stores.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from kvdiet.device import to_host
from kvdiet.formats.codec import CacheCodecs, Codec
from kvdiet.layer_plan import DEFAULT_BLOCK_SIZE
from kvdiet.model.block_ids import BlockAllocator, PrivateBlocks
from kvdiet.model.huge_pages import huge_page_zeros
from kvdiet.model.memory import check_fits

__all__ = ["DevicePool"]


KINDS = ("main", "index")


class DevicePool:
    """Packed global KV of all KV-source layers in ``num_blocks`` blocks of ``block_size`` tokens.

    Args:
        ratios: ``{KV-source layer: compress_ratio}`` (from the `LayerPlan`).
        codecs: the model's cache codecs (``main`` and ``index_key`` are used).
        indexed: the layers that hold index keys beside their main KV; None → every layer (V4.1). V4-Flash's
            HCA layers have no indexer.
        block_size: tokens per block; a multiple of every ratio.
        num_blocks: blocks to preallocate (≥ 1).
        device: where the pool's tensors live (the model's device, `kvdiet.device`).
        blocks: the allocator of the block ids, holding ``num_blocks`` blocks (the cache layer's
            `BlockPool`): the pool stays that size and the cache layer reserves blocks before each forward.
            None: a private `PrivateBlocks`, and the pool is ``growable`` (a model used without an engine):
            it allocates more blocks when full instead of raising.
        huge_pages: on the CPU, the pages on transparent huge pages (`kvdiet.model.huge_pages`; the same bytes,
            read faster); False keeps torch's allocations (a benchmark's baseline: ``bench_layout.py``).
    Raises:
        ValueError: bad block size or count, an allocator of another size, no KV-source layer; on the CPU,
            pages that do not fit in the memory available (`kvdiet.model.memory.InsufficientMemoryError`).
    """

    def __init__(
        self,
        ratios: Mapping[int, int],
        codecs: CacheCodecs,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int,
        blocks: BlockAllocator | None = None,
        indexed: frozenset[int] | None = None,
        device: torch.device | str = "cpu",
        huge_pages: bool = True,
    ) -> None:
        if not ratios:
            raise ValueError("a device pool needs at least one KV-source layer")
        if block_size < 1 or any(r < 1 or block_size % r for r in ratios.values()):
            raise ValueError(
                f"block size {block_size} must be a positive multiple of every compress ratio "
                f"{sorted(set(ratios.values()))}"
            )
        self.ratios = dict(sorted(ratios.items()))
        self.codecs: dict[str, Codec] = {"main": codecs.main, "index": codecs.index_key}
        if blocks is not None and blocks.num_blocks != num_blocks:
            raise ValueError(f"the allocator holds {blocks.num_blocks} blocks, the pool {num_blocks}")
        self.block_size, self.growable = block_size, blocks is None
        self.device = torch.device(device)
        self.huge_pages = huge_pages and self.device.type == "cpu"
        self.blocks: BlockAllocator = PrivateBlocks(num_blocks) if blocks is None else blocks
        self._kinds = {
            layer: tuple(k for k in KINDS if k == "main" or indexed is None or layer in indexed)
            for layer in self.ratios
        }
        shapes = {
            (layer, kind): ((num_blocks, block_size // r, self.codecs[kind].width), self.codecs[kind].dtype)
            for layer, r in self.ratios.items()
            for kind in self._kinds[layer]
        }
        if self.device.type == "cpu":  # one line, not the allocator's error or the OOM killer
            need = sum(math.prod(shape) * dtype.itemsize for shape, dtype in shapes.values())
            check_fits(f"a KV-cache pool of {num_blocks:,} blocks", need)
        self._data = {key: self._zeros(shape, dtype) for key, (shape, dtype) in shapes.items()}

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Zeroed pages on the pool's device; on the CPU on huge pages (`kvdiet.model.huge_pages`: a decode step's
        index scan and gathers read them faster, the same bytes)."""
        if self.huge_pages:
            return huge_page_zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (56,960 for V4.1 at 64 tokens: 890 B/token)."""
        return sum(t[0].numel() * t.element_size() for t in self._data.values())

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def nbytes(self) -> int:
        return self.block_bytes * self.num_blocks

    def entries_per_block(self, layer: int) -> int:
        return self.block_size // self.ratios[layer]

    def rows(self, layer: int, kind: str) -> torch.Tensor:
        """All rows of one layer and kind as ``[num_blocks · entries_per_block, width]`` (a view)."""
        t = self._data[(layer, kind)]
        return t.view(-1, t.shape[-1])

    def pages(self) -> dict[tuple[int, str], torch.Tensor]:
        """Every ``(layer, kind)`` and its page tensor ``[num_blocks, entries_per_block, width]`` (not copied)."""
        return dict(self._data)

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh block ids (growing first if growable); otherwise the allocator's error when it has
        fewer than ``n`` free (`kvdiet.cache.block_pool.NoFreeBlocksError` from the cache layer's pool)."""
        if self.growable and n > self.blocks.num_free:
            self._grow(max(n - self.blocks.num_free, self.num_blocks))
        return self.blocks.allocate(n)

    def _grow(self, extra: int) -> None:
        if self.device.type == "cpu":  # the new pages, while the old are copied over
            check_fits(
                f"a KV-cache pool grown to {self.num_blocks + extra:,} blocks",
                self.block_bytes * (self.num_blocks + extra),
            )
        for key, t in self._data.items():
            grown = self._zeros((t.shape[0] + extra, *t.shape[1:]), t.dtype)
            grown[: t.shape[0]] = t
            self._data[key] = grown
        self.blocks.grow(extra)

    # --- one block as bytes (the persistent tier's payload) ---

    def read_block(self, block_id: int) -> bytes:
        """The block's rows as raw bytes: for each layer (ascending), main rows then index-key rows (if any).

        Gathered on the device, then one crossing to the host (`kvdiet.device.to_host`)."""
        parts = [self._data[(layer, kind)][block_id] for layer in self.ratios for kind in self._kinds[layer]]
        flat = torch.cat([p.contiguous().view(torch.uint8).view(-1) for p in parts])
        return to_host(flat).numpy().tobytes()

    def write_block(self, block_id: int, payload: bytes) -> None:
        """Inverse of `read_block` (the payload crosses to the device once). Raises ValueError when
        ``payload`` is not one block long."""
        if len(payload) != self.block_bytes:
            raise ValueError(f"a block payload is {self.block_bytes} bytes, got {len(payload)}")
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        at = 0
        for layer in self.ratios:
            for kind in self._kinds[layer]:
                dst = self._data[(layer, kind)][block_id]
                n = dst.numel() * dst.element_size()
                dst.view(torch.uint8).view(-1).copy_(flat[at : at + n])
                at += n
