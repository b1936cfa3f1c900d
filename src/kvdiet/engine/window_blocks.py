"""``full-store`` window entries on the engine side: every layer's window rows of a block as one payload.

A block's payload is ``[L, B, width]`` rows in the window codec's dtype, layer-major (``L`` window layers,
``B`` tokens per block), stored beside the block's global KV under `kvdiet.cache.keys.KeyKind.WINDOW_BLOCK`.
`WindowBlockLog` gathers the rows each forward writes into the rings (through the rings' ``log`` hook) and
cuts them into whole blocks; `restore_window_blocks` puts the blocks covering ``[H − W, H)`` back into a
request's rings. The control plane decides when they are written and read (`kvdiet.cache.control`).
"""

from __future__ import annotations

import torch

from kvdiet.device import to_host
from kvdiet.model.state import RequestState
from kvdiet.model.transformer import Transformer

__all__ = ["WindowBlockLog", "restore_window_blocks", "window_block_bytes"]


def window_block_bytes(model: Transformer, block_size: int) -> int:
    """Bytes of one block's window entries of every layer: ``L × B × width × itemsize``."""
    c = model.codecs.window
    return len(model.plan.layers) * block_size * c.width * c.dtype.itemsize


class WindowBlockLog:
    """The window rows a request's forwards wrote, cut into whole blocks (``full-store`` only).

    Args:
        block_size: B (tokens).
        first_block: the first block whose rows are kept (blocks below are already stored).
    """

    def __init__(self, block_size: int, first_block: int) -> None:
        self.block_size = block_size
        self.first_block = first_block
        self.blocks: dict[int, bytes] = {}  # block index → [L, B, width] bytes
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # rows [L, T, width], positions [T]
        self._log: list[tuple[torch.Tensor, torch.Tensor]] = []

    def start(self, state: RequestState) -> None:
        """Record what the next forward writes into ``state``'s rings."""
        self._log = []
        for ring in state.windows:
            ring.log = self._log

    def stop(self, state: RequestState) -> None:
        """Stop recording and cut what was recorded into whole blocks."""
        for ring in state.windows:
            ring.log = None
        log, self._log = self._log, []
        if not log:
            return
        bs = self.block_size
        rows = torch.stack([r for r, _ in log])  # [L, T, width]: one write per layer
        pos = log[0][1]
        if self._pending is not None:
            rows, pos = torch.cat([self._pending[0], rows], 1), torch.cat([self._pending[1], pos])
        done = int(pos[-1] + 1) // bs
        for i in range(max(int(pos[0]) // bs, self.first_block), done):
            sel = (pos >= i * bs) & (pos < (i + 1) * bs)
            if int(sel.sum()) == bs:
                self.blocks[i] = to_host(rows[:, sel].contiguous().view(torch.uint8)).numpy().tobytes()
        keep = pos >= done * bs
        self._pending = (rows[:, keep], pos[keep]) if bool(keep.any()) else None

    def pop(self, block: int) -> bytes | None:
        """Block ``block``'s payload (forgotten here), or None when its rows were not all recorded."""
        return self.blocks.pop(block, None)


def restore_window_blocks(
    model: Transformer, state: RequestState, pos: int, data: bytes, ids: list[int], block_size: int
) -> None:
    """Rewind ``state`` to ``pos`` and fill its rings from ``data``: the payloads of blocks
    ``[max(0, pos − W) // B, pos // B)`` joined in order; only rows of ``[pos − W, pos)`` are kept."""
    bs, w = block_size, model.cfg.sliding_window
    first = max(0, pos - w) // bs * bs
    layers = len(state.windows)
    ring = state.windows[0]
    rows = torch.frombuffer(bytearray(data), dtype=ring.rows.dtype).view(-1, layers, bs, ring.rows.shape[1])
    rows = rows.permute(1, 0, 2, 3).reshape(layers, -1, ring.rows.shape[1])  # [L, tokens, width]
    rows = rows.to(ring.rows.device)  # the stored payloads cross to the device here, once
    positions = torch.arange(first, pos, device=ring.rows.device)
    keep = positions >= pos - w
    model.rewind(state, pos, ids)  # empties rings and tails, history at pos
    for layer, r in enumerate(state.windows):
        slots = positions[keep] % w
        r.rows[slots] = rows[layer][keep]
        r.positions[slots] = positions[keep]
