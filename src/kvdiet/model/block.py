"""One transformer layer of the V4.1 model: optional Engram, attention, MoE, and the mHC parameters of both
sublayers, under DeepSeek's checkpoint names ``layers.{i}.*`` (v41-spec §8.1a).

The block holds the layer's modules and parameters and runs its FFN half (`Block.ffn_half`); the attention
half, which reads and writes request caches, is driven by `kvdiet.model.transformer.Transformer` across the
whole batch.
"""

from __future__ import annotations

import torch
from torch import nn

from kvdiet.config import ModelConfig
from kvdiet.formats.codec import CacheCodecs
from kvdiet.layer_plan import LayerInfo
from kvdiet.model.attention import Attention
from kvdiet.model.decode_ffn import decode_ffn
from kvdiet.model.engram import Engram
from kvdiet.model.hc import add_sublayer_hc, hc_expand, sublayer_coefficients, sublayer_entry
from kvdiet.model.layers import RMSNorm
from kvdiet.model.moe import MoE

__all__ = ["Block"]


class Block(nn.Module):
    """One layer: optional Engram, attention, MoE, and their mHC parameters (``layers.{i}.*`` names)."""

    def __init__(self, cfg: ModelConfig, info: LayerInfo, codecs: CacheCodecs) -> None:
        super().__init__()
        self.cfg, self.info = cfg, info
        self.engram = Engram(cfg, info.layer_id) if info.layer_id in (cfg.engram_layer_ids or ()) else None
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, info, codecs)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = MoE(cfg)
        add_sublayer_hc(self, cfg)

    def coefficients(self, h: torch.Tensor, part: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mHC ``(pre, post, comb)`` of the ``attn`` or ``ffn`` sublayer for streams ``h`` [T, hc, hidden]."""
        return sublayer_coefficients(self, self.cfg, h, part)

    def entry(
        self, h: torch.Tensor, part: str, collapse_pre: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The ``attn`` or ``ffn`` sublayer's normed input from streams ``h`` [T, hc, hidden] collapsed by
        ``collapse_pre`` [T, hc], and its mHC ``(pre, post, comb)`` (`kvdiet.model.hc.sublayer_entry`)."""
        norm = self._modules["attn_norm" if part == "attn" else "ffn_norm"]  # no nn.Module attribute fallback
        return sublayer_entry(self, self.cfg, h, part, collapse_pre, norm)

    def ffn_half(
        self, h: torch.Tensor, attn_pre: torch.Tensor, *, decode_step: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FFN sublayer: returns ``(new streams, this FFN's pre)``. ``decode_step``: the rows are a batched
        decode step's, one per request (the MoE may pad its groups: `MoE.forward`); up to 16 of them run
        without the MoE's module layers where they may (`kvdiet.model.decode_ffn.decode_ffn`: the same bits)."""
        if decode_step:
            done = decode_ffn(self, h, attn_pre)
            if done is not None:
                return done
        x, pre, post, comb = self.entry(h, "ffn", attn_pre)
        return hc_expand(self._modules["ffn"](x, padded=decode_step), h, post, comb), pre
