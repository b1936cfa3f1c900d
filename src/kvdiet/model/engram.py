"""Engram: a hashed n-gram memory added to the residual streams before the block at an Engram layer.

The module side (v41-spec §8.3, §8.3a; DeepSeek's reference ``engram.py`` and ``model.py``): `Engram` (an
``nn.Module``) holds an FP8 (E4M3 + UE8M0 per 32) row table (`Fp8Embedding`), ``wkv`` and the per-stream
gate, and reads the rows that `kvdiet.model.engram_hash.EngramHasher` names for each position. The module
knows nothing of the block it precedes. A decode step's rows take compiled calls (``formats/engram_kernels.cpp``:
the table lookup and the gate, each with the torch formula's bits).
"""

from __future__ import annotations

import torch
from torch import nn

from kvdiet.config import ModelConfig
from kvdiet.device import to_host
from kvdiet.formats import native
from kvdiet.formats.fp8 import quantize_window
from kvdiet.model.checkpoint import Checkpoint
from kvdiet.model.layers import as_dtype
from kvdiet.model.linear import Linear, ue8m0_values
from kvdiet.model.member import member

__all__ = ["Engram", "Fp8Embedding"]

_INIT_STD = 0.02  # config ``initializer_range``
_SCALE_BLOCK = 32  # values per UE8M0 scale of the FP8 table rows


class Fp8Embedding(nn.Module):
    """A row table stored as FP8 E4M3 codes with one UE8M0 scale per 32 values, dequantised on lookup.

    Buffers: ``weight`` uint8 [rows, dim] (E4M3 bit patterns) and ``scale`` uint8 [rows, dim/32] (UE8M0
    exponents), the checkpoint's ``engram.embed.weight`` / ``.scale`` bytes. Default fill: standard-normal
    rows, quantised (``kvdiet.formats.fp8``). A table too large to keep is read row by row from the
    checkpoint instead (`read_rows_from`; the real tables hold 384M rows, ~99 GB each).

    Raises:
        ValueError: ``dim`` is not a multiple of 32.
    """

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        if dim % _SCALE_BLOCK:
            raise ValueError(f"FP8 table rows must be a multiple of {_SCALE_BLOCK} wide, got {dim}")
        self.rows, self.dim = rows, dim
        self._source: tuple[Checkpoint, str, str] | None = None
        codes = torch.empty(rows, dim, dtype=torch.uint8)
        scales = torch.empty(rows, dim // _SCALE_BLOCK, dtype=torch.uint8)
        if codes.device.type != "meta":  # a model built on the meta device is filled by the loader
            codes, scales = quantize_window(torch.randn(rows, dim))
        self.register_buffer("weight", codes)
        self.register_buffer("scale", scales)

    def read_rows_from(self, checkpoint: Checkpoint, weight_name: str, scale_name: str) -> None:
        """Serve lookups from ``checkpoint`` (positioned reads of the rows asked for) instead of memory."""
        self._source = (checkpoint, weight_name, scale_name)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: int64 [...] row ids -> fp32 [..., dim] dequantised rows (one compiled call on a table in memory,
        ``engram_rows``: the same bits).

        Raises:
            IndexError: an id outside the table.
            ValueError: a row's scale byte 255 (NaN).
        """
        if self._source is None:
            kernels = native.fp4_kernels()
            if kernels is not None and ids.dtype == torch.int64 and ids.is_contiguous():
                rows = kernels.engram_rows(self.weight, self.scale, ids)
                if rows is not None:
                    return rows
            codes, scales = self.weight[ids], self.scale[ids]
        else:
            checkpoint, weight_name, scale_name = self._source
            with torch.device("cpu"):  # rows read on the host, then one crossing to the ids' device
                flat = to_host(ids.reshape(-1))
                codes = checkpoint.read_rows(weight_name, flat).view(torch.uint8).view(*ids.shape, self.dim)
                scales = checkpoint.read_rows(scale_name, flat).view(torch.uint8).view(*ids.shape, -1)
            codes, scales = codes.to(ids.device), scales.to(ids.device)
        values = codes.view(torch.float8_e4m3fn).float().unflatten(-1, (-1, _SCALE_BLOCK))
        return (values * ue8m0_values(scales)[..., None]).flatten(-2)


class Engram(nn.Module):
    """The Engram module of one layer (v41-spec §8.3a, "Module"); applied to the streams before the block.

    Parameters/buffers (checkpoint names under ``layers.{i}.engram.``): ``embed.weight`` uint8
    [rows, head_dim], ``embed.scale`` uint8 [rows, head_dim/32] (rows = ``engram_num_embeddings`` of this
    layer), ``wkv.weight`` [hidden·(hc+1), n_cols·head_dim], ``q_weight`` and ``k_weight`` [hc, hidden]
    (init ones). The default fill materialises the whole table, so build it for the presets only: the real
    config's tables are 384M rows × 264 B ≈ 101 GB each.

    Args:
        cfg: the model config.
        layer_id: a model layer in ``engram_layer_ids`` (selects the table size).
    Raises:
        ValueError: no Engram fields in ``cfg``, ``layer_id`` not an Engram layer, ``engram_head_dim`` not a
            multiple of 32.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        layers, sizes = cfg.engram_layer_ids, cfg.engram_num_embeddings
        if not layers or not sizes or cfg.engram_head_dim is None or cfg.engram_max_ngram_size is None:
            raise ValueError(f"config {cfg.name!r} has no Engram fields")
        if cfg.engram_n_heads is None:
            raise ValueError(f"config {cfg.name!r} has no engram_n_heads")
        if layer_id not in layers:
            raise ValueError(f"layer {layer_id} is not an Engram layer (engram_layer_ids {list(layers)})")
        self.layer_id = layer_id
        self.hidden = cfg.hidden_size
        self.hc_mult = cfg.hc_mult
        self.eps = cfg.rms_norm_eps
        self.n_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        self.head_dim = cfg.engram_head_dim
        self.embed = Fp8Embedding(sizes[layers.index(layer_id)], self.head_dim)
        self.wkv = Linear(self.n_cols * self.head_dim, self.hidden * (self.hc_mult + 1))
        if self.wkv.weight.device.type != "meta":
            nn.init.normal_(self.wkv.weight, std=_INIT_STD)
        self.q_weight = nn.Parameter(torch.ones(self.hc_mult, self.hidden, dtype=torch.float32))
        self.k_weight = nn.Parameter(torch.ones(self.hc_mult, self.hidden, dtype=torch.float32))

    def forward(self, h: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
        """Gate the shared value into every stream.

        ``kv = wkv(concat of the n_cols dequantised rows)`` splits into keys [hc, hidden] (first hc·hidden
        values) and one value [hidden] (the last hidden values). Per (token, stream):
        ``dot = Σ_d h·(q_weight⊙k_weight)·key · rsqrt(mean(h²)+eps) · rsqrt(mean(key²)+eps) · hidden^−½``,
        ``gate = σ(sign(dot)·sqrt(max(|dot|, 1e−6)))``; the output is ``h + gate·value``.

        Args:
            h: streams [..., T, hc, hidden] (promoted to fp32).
            row_ids: int64 [..., T, n_cols] from `EngramHasher.row_ids` for this layer.
        Returns:
            fp32 [..., T, hc, hidden].
        """
        h = as_dtype(h, torch.float32)  # ``.float()`` without its dispatch when it is fp32 already
        mods = self._modules  # no nn.Module attribute fallback (a microsecond each)
        rows = mods["embed"](row_ids).flatten(-2)  # [..., T, n_cols·head_dim]
        kv = mods["wkv"](rows)  # [..., T, (hc+1)·hidden]
        q_weight, k_weight = member(self, "q_weight"), member(self, "k_weight")
        if h.dim() == 3 and not torch.is_grad_enabled() and (kernels := native.fp4_kernels()) is not None:
            out = kernels.engram_gate(h, kv, q_weight, k_weight, self.eps)  # a decode step's rows: one call
            if out is not None:
                return out
        split = self.hc_mult * self.hidden
        # the slices as narrow views (Python indexing parses its key on every call)
        key = kv.narrow(-1, 0, split).unflatten(-1, (self.hc_mult, self.hidden))  # [..., T, hc, hidden]
        value = kv.narrow(-1, split, kv.shape[-1] - split)  # [..., T, hidden]
        w = as_dtype(q_weight, torch.float32) * as_dtype(k_weight, torch.float32)
        # the two rsqrt factors multiplied first, as DeepSeek's reference orders it
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * w * key).sum(-1) * rstd * self.hidden**-0.5  # [..., T, hc]
        gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp(min=1e-6)))
        return h + gate.unsqueeze(-1) * value.unsqueeze(-2)
