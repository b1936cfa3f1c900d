"""One interface over the entry formats, so caches and the reference path never branch on a format.

A `Codec` turns fp32 vectors ``[..., dim]`` into stored rows ``[..., width]`` and back. A packed codec
stores a format's bytes (uint8, ``width = bytes_per_entry``); the exact codec stores fp32 rows unchanged
(the unquantised mode of the exactness tests). `Codec.roundtrip` is what a stored value reads back as;
the no-cache reference applies it at the same points where the cached path stores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from kvdiet.formats import fp4, fp8, mxfp4
from kvdiet.formats.layout import EntryFormat, index_key_format, main_kv_format, window_format

__all__ = ["CacheCodecs", "Codec", "exact_codec", "packed_codec"]


@dataclass(frozen=True, slots=True)
class Codec:
    """Stores vectors of ``dim`` values as rows of ``width`` elements of ``dtype``.

    Attributes:
        name: format name (``fp32`` for the exact codec); part of a cache's identity.
        dim: values per vector.
        width: elements per stored row.
        dtype: element type of stored rows (uint8 for packed formats).
        encode: fp32 ``[..., dim]`` → rows ``[..., width]``.
        decode: rows ``[..., width]`` → fp32 ``[..., dim]``.
    """

    name: str
    dim: int
    width: int
    dtype: torch.dtype
    encode: Callable[[torch.Tensor], torch.Tensor]
    decode: Callable[[torch.Tensor], torch.Tensor]

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))`` in fp32: what a stored value reads back as."""
        return self.decode(self.encode(x))

    @property
    def bytes_per_entry(self) -> int:
        """Bytes one stored row occupies."""
        return self.width * torch.empty((), dtype=self.dtype).element_size()


def exact_codec(dim: int) -> Codec:
    """fp32 rows, unchanged (``roundtrip`` is the identity on fp32 input)."""
    return Codec(
        "fp32", dim, dim, torch.float32, lambda x: x.to(torch.float32).clone(), lambda r: r.float().clone()
    )


def packed_codec(fmt: EntryFormat, module: ModuleType, suffix: str) -> Codec:
    """The packed codec of ``fmt``, from ``module``'s fused ``encode_{suffix}`` / ``decode_{suffix}``."""
    return Codec(
        fmt.name,
        fmt.dim,
        fmt.bytes_per_entry,
        torch.uint8,
        getattr(module, f"encode_{suffix}"),
        getattr(module, f"decode_{suffix}"),
    )


@dataclass(frozen=True, slots=True)
class CacheCodecs:
    """The three V4.1 cache codecs of a model: main KV, index keys, window entries (v41-spec §5.2)."""

    main: Codec
    index_key: Codec
    window: Codec

    @classmethod
    def for_dims(cls, head_dim: int, index_head_dim: int, *, exact: bool = False) -> CacheCodecs:
        """Codecs for KV vectors of ``head_dim`` and index keys of ``index_head_dim``; ``exact`` → fp32."""
        if exact:
            return cls(exact_codec(head_dim), exact_codec(index_head_dim), exact_codec(head_dim))
        return cls(
            packed_codec(main_kv_format(head_dim), fp4, "main_kv"),
            packed_codec(index_key_format(index_head_dim), mxfp4, "index_key"),
            packed_codec(window_format(head_dim), fp8, "window"),
        )
