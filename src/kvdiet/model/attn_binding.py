"""`AttnBinding`: one layer's attention weights bound once for the compiled ``attn_head`` and ``attn_tail``
(``formats/layer_kernels.cpp``), which run a decode step's attention sublayer around its cache reads in two calls.

The pieces they stand in for (`kvdiet.model.hc.sublayer_entry`, the projections of
`kvdiet.model.decode_step.decode_attention` through `kvdiet.model.fused_rows`, `decode_attend`, `hc_expand`) read the
weights through some 60 Python calls a layer; a binding reads them once and, before each step, checks that the
modules still hold what it bound (`kvdiet.model.module_reads.ModuleReads`: the same rule as
`kvdiet.model.ffn_binding.FfnBinding`).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from kvdiet.config import ModelConfig
from kvdiet.model.attention import Attention
from kvdiet.model.ffn_binding import entry_weights, in_place
from kvdiet.model.hc import HcWeights
from kvdiet.model.layers import RMSNorm
from kvdiet.model.linear import Linear
from kvdiet.model.module_reads import ModuleReads, Transient

__all__ = ["AttnBinding"]

_LINEARS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
_NORMS = ("q_norm", "kv_norm")


class AttnBinding(Transient):
    """The weights of one layer's attention sublayer as the compiled ``AttnWeights`` (``weights``; None where the
    layer does not fit the compiled calls: then `holds` still tells when to try again), the `Attention` module
    bound (``attn``), its RoPE width (``rope_dim``), the `HcWeights` held (``hc``) and what was read (``reads``)."""

    __slots__ = ("attn", "hc", "reads", "rope_dim", "weights")

    def __init__(
        self, weights: object | None, attn: nn.Module, rope_dim: int, hc: HcWeights, reads: ModuleReads
    ) -> None:
        self.weights, self.attn, self.rope_dim, self.hc, self.reads = weights, attn, rope_dim, hc, reads

    def holds(self, hc: HcWeights) -> bool:
        """Whether ``hc`` is the `HcWeights` bound (`kvdiet.model.hc.sublayer_weights`' current layout) and the
        modules still hold every read (`ModuleReads.holds`)."""
        return hc is self.hc and self.reads.holds()

    @classmethod
    def bind(
        cls, block: nn.Module, cfg: ModelConfig, hc: HcWeights, kernels: ModuleType, mix: tuple[int, int, int]
    ) -> AttnBinding:
        """Read ``block``'s attention sublayer (``attn_norm``, ``attn`` and its projections) into a binding; its
        ``weights`` are None where the compiled calls do not apply: a forward hook or an instance's ``forward``,
        modules other than exactly `RMSNorm`, `Attention`, `Linear`, a setting kept on a class rather than the
        instance, a selection observer (it sees each step's top-k through the pieces), or a weight not stored
        dense fp32 in its module's own parameters."""
        reads = ModuleReads()
        reads.read(block.__dict__, "cfg")  # its eps and Sinkhorn settings are bound too
        norm, attn = reads.module(block, "attn_norm"), reads.module(block, "attn")
        if type(norm) is not RMSNorm or type(attn) is not Attention:  # another module's own code runs
            return cls(None, attn, 0, hc, reads.freeze())
        linears = {name: reads.module(attn, name) for name in _LINEARS}
        norms = {name: reads.module(attn, name) for name in _NORMS}
        if any(type(m) is not Linear for m in linears.values()) or any(
            type(m) is not RMSNorm for m in norms.values()
        ):
            return cls(None, attn, 0, hc, reads.freeze())
        try:
            dense = {name: reads.read(lin._parameters, "weight") for name, lin in linears.items()}
            norm_weights = {
                name: reads.read(n._parameters, "weight") for name, n in [("attn_norm", norm), *norms.items()]
            }
            eps = {name: reads.setting(n, "eps") for name, n in [("attn_norm", norm), *norms.items()]}
            sink = reads.read(attn._parameters, "attn_sink")
            rope = reads.read(attn.__dict__, "rope")
            observer = reads.setting(attn, "selection_observer")
            heads, head_dim = reads.setting(attn, "n_heads"), reads.setting(attn, "head_dim")
            groups, scale = reads.setting(attn, "n_groups"), reads.setting(attn, "scale")
        except KeyError:  # a setting kept on the class, not the instance: the pieces read it each call
            return cls(None, attn, 0, hc, reads.freeze())
        weights = None
        if (
            not reads.freeze().overridden
            and observer is None
            and all(lin.storage == "dense" for lin in linears.values())
            and all(in_place(w) for w in dense.values())
            and all(w is not None for w in norm_weights.values())
            and sink is not None
            and sink.dtype == torch.float32
        ):
            weights = kernels.AttnWeights(
                entry_weights(kernels, cfg, hc, mix, norm_weights["attn_norm"], eps["attn_norm"]), dense["wq_a"],
                norm_weights["q_norm"], eps["q_norm"], dense["wq_b"], heads, head_dim, dense["wkv"],
                norm_weights["kv_norm"], eps["kv_norm"], rope.rope_dim, sink, scale, dense["wo_a"], groups,
                dense["wo_b"],
            )  # fmt: skip
        return cls(weights, attn, rope.rope_dim, hc, reads)
