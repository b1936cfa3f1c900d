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
from kvdiet.model.engram import Engram
from kvdiet.model.hc import hc_coefficients, hc_collapse, hc_expand
from kvdiet.model.layers import RMSNorm
from kvdiet.model.moe import MoE

__all__ = ["Block"]


class Block(nn.Module):
    """One layer: optional Engram, attention, MoE, and their mHC parameters (``layers.{i}.*`` names)."""

    def __init__(self, cfg: ModelConfig, info: LayerInfo, codecs: CacheCodecs) -> None:
        super().__init__()
        hc, mix = cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
        self.cfg, self.info = cfg, info
        self.engram = Engram(cfg, info.layer_id) if info.layer_id in (cfg.engram_layer_ids or ()) else None
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, info, codecs)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = MoE(cfg)
        for part in ("attn", "ffn"):
            self.register_parameter(f"hc_{part}_fn", nn.Parameter(torch.zeros(mix, hc * cfg.hidden_size)))
            self.register_parameter(f"hc_{part}_base", nn.Parameter(torch.zeros(mix)))
            self.register_parameter(f"hc_{part}_scale", nn.Parameter(torch.ones(3)))

    def coefficients(self, h: torch.Tensor, part: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mHC ``(pre, post, comb)`` of the ``attn`` or ``ffn`` sublayer for streams ``h`` [T, hc, hidden]."""
        c = self.cfg
        return hc_coefficients(
            h,
            getattr(self, f"hc_{part}_fn"),
            getattr(self, f"hc_{part}_scale"),
            getattr(self, f"hc_{part}_base"),
            hc_mult=c.hc_mult,
            rms_eps=c.rms_norm_eps,
            hc_eps=c.hc_eps,
            sinkhorn_iters=c.hc_sinkhorn_iters,
        )

    def ffn_half(self, h: torch.Tensor, attn_pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """FFN sublayer: returns ``(new streams, this FFN's pre)``."""
        pre, post, comb = self.coefficients(h, "ffn")
        out = self.ffn(self.ffn_norm(hc_collapse(h, attn_pre)))
        return hc_expand(out, h, post, comb), pre
