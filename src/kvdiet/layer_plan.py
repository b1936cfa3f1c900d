"""The layer plan: what each transformer layer owns and where it reads compressed KV and top-k from.

V4.1 (CSA2, v41-spec §1.2, derived as DeepSeek's reference and vLLM do):
- ``swa-only``: ratio 0; a window ring and nothing else.
- ``full``: in ``kv_source_layer_ids``; owns a compressor (main-KV cache) and an indexer that writes index
  keys (every V4.1 KV source is also an index source).
- ``reindex``: an index source that is not a KV source; owns index queries/weights, scores the index keys
  of ``kv_src(l)`` and publishes its own top-k.
- ``reuse``: ratio > 0 with neither; reads the KV of ``kv_src(l)`` and the top-k of ``idx_src(l)`` unchanged.
with ``kv_src(l) = max(s in kv_sources, s <= l)`` and ``idx_src(l) = max(s in index_sources, s <= l)``.
The layer named by ``candidate_source_layer_id`` is the candidate source (it publishes a pool of
``candidate_topk_blocks`` blocks); index sources above it are candidate consumers. The causal
encoder–decoder split (v41-spec §6) is at the last KV source: layers below it are the encoder.

V4 (baseline, v41-spec §1.3, V4REF): every layer with ratio > 0 compresses its own KV; ratio 4 layers
(``csa``) also own an indexer with top-k, ratio 128 layers (``hca``) attend every visible entry.

Entries of ``compress_ratios`` past ``num_hidden_layers`` belong to the DSpark/MTP blocks and get no
role here.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from enum import StrEnum

from kvdiet.config import ModelConfig

__all__ = ["DEFAULT_BLOCK_SIZE", "V4_BLOCK_SIZE", "V4_CSA_RATIO", "LayerInfo", "LayerPlan", "Role"]

DEFAULT_BLOCK_SIZE = 64
"""Tokens per block of the paged device pool (vLLM's block size for DeepSeek-V4 models); a multiple of every
compress ratio (`LayerPlan.check_block_size`). Here so that the model and the cache layer share it without
importing each other."""

V4_BLOCK_SIZE = 128
"""V4-Flash's block size when none is chosen: the smallest that holds whole HCA entries (ratio 128)."""

# V4REF builds an indexer only for compress_ratio == 4 layers (v41-spec §1.3, §9).
V4_CSA_RATIO = 4


class Role(StrEnum):
    """What a layer owns (see the module docstring)."""

    SWA_ONLY = "swa-only"
    FULL = "full"
    REINDEX = "reindex"
    REUSE = "reuse"
    CSA = "csa"
    HCA = "hca"


@dataclass(frozen=True, slots=True)
class LayerInfo:
    """One layer's role and sources.

    Attributes:
        layer_id: index in ``[0, num_hidden_layers)``.
        role: see `Role`.
        compress_ratio: tokens per compressed entry (0: SWA only).
        kv_src: the layer whose compressed KV this layer attends (itself for a source); None at ratio 0.
        idx_src: the layer whose top-k this layer uses (itself for an index source); None where there is
            no indexer (ratio 0, and V4 HCA layers, which attend all visible entries).
        candidate: ``"source"``, ``"consumer"`` or None (hierarchical candidate pool, v41-spec §4).
    """

    layer_id: int
    role: Role
    compress_ratio: int
    kv_src: int | None
    idx_src: int | None
    candidate: str | None = None

    @property
    def owns_compressed_kv(self) -> bool:
        """Writes main-KV entries to its own compressed cache."""
        return self.role in (Role.FULL, Role.CSA, Role.HCA)

    @property
    def owns_index_keys(self) -> bool:
        """Writes index keys (V4.1 Full layers, V4 CSA layers)."""
        return self.role in (Role.FULL, Role.CSA)

    @property
    def owns_indexer(self) -> bool:
        """Has index queries and weights of its own and publishes a top-k."""
        return self.role in (Role.FULL, Role.REINDEX, Role.CSA)


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """Roles of all ``num_hidden_layers`` layers of a config.

    Attributes:
        layers: one `LayerInfo` per layer, in order.
        decoder_start: first decoder layer of V4.1's causal encoder–decoder (the last KV source), or None
            (V4). Layers at or after it run only on each prompt's last window rows in bounded-replay
            prefill.
    """

    layers: tuple[LayerInfo, ...]
    decoder_start: int | None

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> LayerPlan:
        """Derive the plan (a validated `ModelConfig` guarantees every source lookup succeeds)."""
        if cfg.is_v41:
            return cls(
                tuple(_v41_layer(cfg, layer) for layer in range(cfg.num_hidden_layers)),
                decoder_start=max(cfg.kv_source_layer_ids or (0,)),
            )
        return cls(tuple(_v4_layer(layer, r) for layer, r in enumerate(cfg.layer_ratios)), decoder_start=None)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer_id: int) -> LayerInfo:
        return self.layers[layer_id]

    def ids(self, role: Role) -> list[int]:
        """Layer ids with ``role``, ascending."""
        return [info.layer_id for info in self.layers if info.role is role]

    def roles(self) -> dict[str, list[int]]:
        """``{role name: layer ids}`` for the roles present, in `Role` order."""
        return {role.value: ids for role in Role if (ids := self.ids(role))}

    @property
    def kv_sources(self) -> list[int]:
        """Layers that own a compressed main-KV cache."""
        return [info.layer_id for info in self.layers if info.owns_compressed_kv]

    def check_block_size(self, block_size: int) -> None:
        """Raises ValueError unless ``block_size`` (tokens) is a positive multiple of the compress ratio of
        every KV-source layer (a block holds whole compressed entries of each; the device pool's rule, checked
        here from the config alone, before a model is built)."""
        if block_size < 1 or block_size % self.block_unit:
            ratios = sorted({self.layers[s].compress_ratio for s in self.kv_sources})
            raise ValueError(
                f"block size {block_size} must be a positive multiple of every compress ratio {ratios}"
            )

    @property
    def block_unit(self) -> int:
        """The smallest block size (tokens) `check_block_size` accepts, which every accepted one is a multiple
        of: the least common multiple of the KV-source layers' compress ratios (V4.1-Flash 2, V4-Flash 128), where
        every KV source's compression groups start together (a bounded replay's start is a multiple of it)."""
        return math.lcm(*(self.layers[s].compress_ratio for s in self.kv_sources))

    @property
    def encoder_layers(self) -> list[int]:
        """V4.1 encoder layers (before `decoder_start`); all layers for V4."""
        end = len(self.layers) if self.decoder_start is None else self.decoder_start
        return list(range(end))


def _last_at_or_below(ids: tuple[int, ...], layer: int) -> int | None:
    pos = bisect.bisect_right(ids, layer)
    return ids[pos - 1] if pos else None


def _v41_layer(cfg: ModelConfig, layer: int) -> LayerInfo:
    r = cfg.compress_ratios[layer]
    if r == 0:
        return LayerInfo(layer, Role.SWA_ONLY, 0, None, None)
    kv_ids, idx_ids = cfg.kv_source_layer_ids or (), cfg.index_source_layer_ids or ()
    if layer in kv_ids:
        role = Role.FULL
    elif layer in idx_ids:
        role = Role.REINDEX
    else:
        role = Role.REUSE
    candidate = None
    c = cfg.candidate_source_layer_id
    if c is not None and layer in idx_ids:
        candidate = "source" if layer == c else "consumer" if layer > c else None
    return LayerInfo(
        layer, role, r, _last_at_or_below(kv_ids, layer), _last_at_or_below(idx_ids, layer), candidate
    )


def _v4_layer(layer: int, r: int) -> LayerInfo:
    if r == 0:
        return LayerInfo(layer, Role.SWA_ONLY, 0, None, None)
    if r == V4_CSA_RATIO:
        return LayerInfo(layer, Role.CSA, r, layer, layer)
    return LayerInfo(layer, Role.HCA, r, layer, None)
