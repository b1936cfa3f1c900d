"""`pack_weights`: a CPU model's parameters moved into one arena, in the order a decode step reads them, on
transparent huge pages.

A one-request decode step reads every layer's weights once, cold from DRAM, in short runs: v4.1-mini's products
read 0.1–1 MB each (a 128 KB expert matrix, a 1 MB query projection), too short for the hardware prefetchers to
reach the read bandwidth (one such product alone reads at 8–24 GB/s against 41 GB/s for a 64 MB one, stop 49).
Left to torch's allocator, each parameter is an allocation of its own in 4 KiB pages, wherever the allocator put
it. Here the parameters of each layer lie back to back in the order a decode step reads them (`READ_ORDER`: the
layer's Engram, its attention's mHC entry and projections, compressor, indexer and output, then the FFN's), the
layers one after another, then the final norm and the LM head, in one mapping on 2 MiB pages
(`kvdiet.model.huge_pages`): each product's run continues where the last one ended, one TLB entry per 2 MiB.

Every parameter keeps its dtype, shape, values and a 64-byte aligned start (the CPU allocator's alignment of a
fresh tensor), so every kernel, torch's included, reads the same bits; only where they lie changes. A parameter
is left where it is when it is on another device or the meta device (routed experts a checkpoint serves on first
use), not contiguous, or shares its storage with another tensor of the model, a buffer or the token embedding
included (tied weights stay tied). The token embedding stays too: a step reads one row of it.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from kvdiet.model.huge_pages import huge_page_mapping

__all__ = ["READ_ORDER", "WeightArena", "pack_weights"]

# A layer's parameter names (prefixes of ``layers.{i}.`` names) in the order a decode step reads them; names that
# match none follow, in registration order.
READ_ORDER = (
    "engram.",
    "hc_attn_",
    "attn_norm.",
    "attn.wq_a.",
    "attn.q_norm.",
    "attn.wq_b.",
    "attn.indexer.wq_b.",
    "attn.indexer.weights_proj.",
    "attn.wkv.",
    "attn.kv_norm.",
    "attn.compressor.",
    "attn.indexer.",
    "attn.attn_sink",
    "attn.wo_a.",
    "attn.wo_b.",
    "hc_ffn_",
    "ffn_norm.",
    "ffn.gate.",
    "ffn.experts.",
    "ffn.shared_experts.",
)
_ALIGN = 64  # bytes: each parameter's start, as the CPU allocator aligns a fresh tensor
_TRIM_BYTES = 64 << 20  # bytes moved between returns of the freed heap pages to the system


@dataclass(frozen=True, slots=True)
class WeightArena:
    """What `pack_weights` packed (the parameters' views keep the mapping itself alive).

    Attributes:
        nbytes: the bytes the parameters take, each start 64-byte aligned.
        count: how many parameters it holds.
    """

    nbytes: int
    count: int


def _read_rank(name: str) -> int:
    """A layer parameter's place in `READ_ORDER` (len(READ_ORDER) for a name it does not list)."""
    for i, prefix in enumerate(READ_ORDER):
        if name.startswith(prefix):
            return i
    return len(READ_ORDER)


def _in_read_order(model: nn.Module) -> Iterator[nn.Parameter]:
    """The model's parameters in the order a decode step reads them: each of ``model.layers`` in `READ_ORDER`,
    then the rest in registration order, the token embedding (``embed``) excepted."""
    layers = model.get_submodule("layers") if hasattr(model, "layers") else None
    if isinstance(layers, nn.ModuleList):
        for layer in layers:
            named = list(layer.named_parameters())
            yield from (p for _, p in sorted(named, key=lambda kv: _read_rank(kv[0])))  # a stable sort
    for name, p in model.named_parameters():
        if not name.startswith(("layers.", "embed.")):
            yield p


def _movable(model: nn.Module, params: list[nn.Parameter]) -> list[nn.Parameter]:
    """Those of ``params`` that can move: on the CPU, not empty, contiguous from their storage's start to its end,
    and the only tensor of ``model`` on that storage, its parameters and buffers all counted (a weight tied to
    another, the token embedding or a buffer included, stays where it is, tied)."""
    storages: dict[int, int] = {}
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}  # each object once
    for t in tensors.values():
        if t.device.type == "cpu":
            key = t.untyped_storage().data_ptr()
            storages[key] = storages.get(key, 0) + 1
    return [
        p
        for p in params
        if p.device.type == "cpu"
        and p.numel() > 0
        and p.is_contiguous()
        and p.storage_offset() == 0
        and p.untyped_storage().nbytes() == p.numel() * p.element_size()
        and storages[p.untyped_storage().data_ptr()] == 1
    ]


def _return_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``): storages under glibc's mmap
    threshold (up to 32 MiB) are freed into the heap and stay resident otherwise. Nothing where there is no
    glibc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def pack_weights(model: nn.Module) -> WeightArena | None:
    """Move ``model``'s parameters into one arena in decode-read order (module docstring); returns it, or None
    where no parameter can move. Call it before the first forward, without autograd recording: each parameter's
    ``.data`` is replaced by a tensor over its place in the arena holding the same values, on a storage of its own
    over those bytes, so it pickles, copies and saves as its own bytes (its `torch.nn.Parameter` object, dtype,
    shape and ``requires_grad`` stay). Caches keyed by a parameter's data pointer (`kvdiet.model.hc.HcWeights`)
    see the new pointer and rebuild.

    Memory: the arena is written as each parameter moves, each old storage is freed as it moves (where nothing
    else holds it), and the freed heap pages go back to the system every `_TRIM_BYTES` moved and at the end
    (`_return_freed_memory`): resident afterwards, what the model held before (v4.1-mini: 862 MiB before and
    after, some 110 MiB more without the trims); at the peak, that plus up to 64 MiB and the largest parameter
    (v4.1-mini: 1,044 MiB).
    """
    in_order = list({id(p): p for p in _in_read_order(model)}.values())  # each object once, first place kept
    params = _movable(model, in_order)
    if not params:
        return None
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
    mapping, base = huge_page_mapping(total)  # each byte written below
    moved = 0
    with torch.no_grad():
        for p, start in zip(params, offsets, strict=True):
            nbytes = p.numel() * p.element_size()
            # a storage of its own over the arena's bytes (it keeps the mapping alive): a parameter pickles,
            # copies and saves as its own bytes, not the whole arena's
            view = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=base + start)
            view = view.view(p.dtype).view(p.shape)
            view.copy_(p.data)
            p.data = view
            moved += nbytes
            if moved >= _TRIM_BYTES:
                _return_freed_memory()
                moved = 0
    _return_freed_memory()
    return WeightArena(total, len(params))
