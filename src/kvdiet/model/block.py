"""One transformer layer of the V4.1 model: optional Engram, attention, MoE, and the mHC parameters of both
sublayers, under DeepSeek's checkpoint names ``layers.{i}.*`` (v41-spec §8.1a).

The block holds the layer's modules and parameters and runs its FFN half (`Block.ffn_half`); the attention
half, which reads and writes request caches, is driven by `kvdiet.model.transformer.Transformer` across the
whole batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kvdiet.config import ModelConfig
from kvdiet.formats.codec import CacheCodecs
from kvdiet.layer_plan import LayerInfo
from kvdiet.model import decode_step
from kvdiet.model.attention import Attention
from kvdiet.model.decode_ffn import decode_ffn
from kvdiet.model.engram import Engram
from kvdiet.model.hc import add_sublayer_hc, hc_expand, sublayer_coefficients, sublayer_entry
from kvdiet.model.layers import RMSNorm
from kvdiet.model.linear import Linear
from kvdiet.model.moe import Gate, MoE

if TYPE_CHECKING:
    from kvdiet.model.attn_binding import AttnBinding
    from kvdiet.model.ffn_binding import FfnBinding

__all__ = ["Block", "pieces_unpatched"]


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
        # the weights bound for a decode step's compiled calls (kvdiet.model.decode_layer, decode_ffn)
        self.attn_binding: AttnBinding | None = None
        self.ffn_binding: FfnBinding | None = None

    def pieces_own(self) -> bool:
        """Whether this block's decode path is kvdiet's own: the block exactly a `Block` and none of the functions
        that path calls patched (`Block.entry`, `Block.ffn_half`, ``decode_ffn``, `Attention.forward`,
        `DecodePlan.attend`, ``decode_step.decode_attention`` and ``decode_attend``, `Gate.forward`, `MoE.fetch`,
        and the ``forward`` of `MoE`, `Linear` and `RMSNorm`, which the pieces call through their modules).
        The compiled calls that stand in for them (`kvdiet.model.decode_layer`, `kvdiet.model.decode_ffn`) run
        only then: a spy or a patch of one sees the step."""
        return type(self) is Block and pieces_unpatched()

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


def pieces_unpatched() -> bool:
    """Whether none of the functions a decode step's pieces call is patched (see `Block.pieces_own`)."""
    return _pieces() == _OWN_PIECES


def _pieces() -> tuple[object, ...]:
    """The functions a decode step's pieces call, as they are now."""
    step = decode_step
    return (
        Block.entry, Block.ffn_half, decode_ffn, Attention.forward, step.DecodePlan.attend, step.decode_attention,
        step.decode_attend, Gate.forward, MoE.fetch, MoE.forward, Linear.forward, RMSNorm.forward,
    )  # fmt: skip


_OWN_PIECES = _pieces()
