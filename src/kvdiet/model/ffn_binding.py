"""`FfnBinding`: one layer's FFN weights bound once for the compiled ``ffn_rows`` (``formats/layer_kernels.cpp``),
which runs a decode step's whole FFN half (mHC entry, router, experts, mHC exit) in one call.

`kvdiet.model.decode_ffn.decode_ffn` reads a layer's weights through some 45 Python calls a step (the checks and
lookups of each piece it calls); a binding reads them once and, before each call, only checks that the modules
still hold what it bound (`kvdiet.model.module_reads.ModuleReads`). A replaced parameter, submodule or setting, a
hook, a weight re-stored by `Linear.set_weight` (a new storage comes with a new parameter) or a rebuilt `HcWeights`
binds the layer again; an in-place write to a bound weight needs nothing (the kernels read the tensor itself). On
v4.1-mini the check costs ~5 µs a layer, the FFN half 52 → 42 µs warm.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from kvdiet.config import ModelConfig
from kvdiet.model.chain_products import chain_fits, weight_block
from kvdiet.model.hc import HcWeights
from kvdiet.model.layers import RMSNorm
from kvdiet.model.module_reads import ModuleReads, Transient
from kvdiet.model.moe import Gate, MoE

__all__ = ["FfnBinding", "entry_weights", "in_place"]


class FfnBinding(Transient):
    """The weights of one layer's FFN half as the compiled ``FfnWeights`` (``weights``; None where the layer does
    not fit the compiled call: then `holds` still tells when to try again), the `HcWeights` they hold (``hc``) and
    what they were read from: ``reads`` (all but the routed experts, checked before a call) and ``experts`` (each
    routed expert's own reads, checked after a call for the experts it routed to, `routed_current`: a step reads
    2 of 8 experts' modules, as the pieces do, not all of them)."""

    __slots__ = ("experts", "hc", "reads", "weights")

    def __init__(
        self, weights: object | None, hc: HcWeights, reads: ModuleReads, experts: list[ModuleReads]
    ) -> None:
        self.weights, self.hc, self.reads, self.experts = weights, hc, reads, experts

    def holds(self, hc: HcWeights) -> bool:
        """Whether ``hc`` is the `HcWeights` bound (`kvdiet.model.hc.sublayer_weights`' current layout) and the
        modules still hold every read but the routed experts' (`ModuleReads.holds`)."""
        return hc is self.hc and self.reads.holds()

    def routed_current(self, ids: torch.Tensor) -> bool:
        """Whether the routed experts ``ids`` (int64 [B, k], as ``ffn_rows`` returns them) are still the modules
        and weights bound: the call read no others, so its result stands exactly when they are."""
        experts = self.experts
        return all(experts[e].holds() for e in set(ids.view(-1).tolist()))

    @classmethod
    def bind(
        cls, block: nn.Module, cfg: ModelConfig, hc: HcWeights, kernels: ModuleType, mix: tuple[int, int, int]
    ) -> FfnBinding:
        """Read ``block``'s FFN half (``ffn_norm``, ``ffn``) into a binding; its ``weights`` are None where the
        compiled call does not apply: a forward hook or an instance's ``forward``, modules other than exactly
        `RMSNorm`, `MoE`, `Gate`, a hash-routed gate, routed experts read on first use (an expert cache sees the
        pieces' reads), an instance's own ``fetch``, a top-k outside 1..15, a gate weight the router's kernel
        would not read in place (`in_place`), or an expert weight not stored dense in its module's own
        parameters."""
        reads = ModuleReads()
        reads.read(block.__dict__, "cfg")  # its eps and Sinkhorn settings are bound too
        norm, moe = reads.module(block, "ffn_norm"), reads.module(block, "ffn")
        if type(norm) is not RMSNorm or type(moe) is not MoE:  # another module's own code: the module path
            return cls(None, hc, reads.freeze(), [])
        gate = reads.module(moe, "gate")
        if type(gate) is not Gate:
            return cls(None, hc, reads.freeze(), [])
        experts_list = reads.read(moe._modules, "experts")
        # the routed experts each in reads of their own; the shared expert, always run, with the rest. Experts
        # and their linears are read as the pieces read them (`Expert.dense_weights`): no hook checks
        expert_reads = [ModuleReads() for _ in experts_list._modules]
        try:
            norm_weight, eps = reads.read(norm._parameters, "weight"), reads.setting(norm, "eps")
            gate_weight, gate_bias = (
                reads.read(gate._parameters, "weight"),
                reads.read(gate._parameters, "bias"),
            )
            routed, fetch = reads.read(moe.__dict__, "routed"), reads.read(moe.__dict__, "fetch")
            hashed = reads.read(gate._buffers, "tid2eid")
            topk, normalize = reads.setting(gate, "topk"), reads.setting(gate, "norm_topk_prob")
            scaling = reads.setting(gate, "routed_scaling_factor")
            experts = [
                r.read(experts_list._modules, key)
                for r, key in zip(expert_reads, experts_list._modules, strict=True)
            ]
            experts.append(reads.read(moe._modules, "shared_experts"))
            limits, linears, dense = [], [], []
            for expert, own in zip(experts, [*expert_reads, reads], strict=True):
                limits.append(float(own.setting(expert, "swiglu_limit")))
                for name in ("w1", "w3", "w2"):
                    lin = own.read(expert._modules, name)
                    linears.append(lin)
                    dense.append(own.read(lin._parameters, "weight"))
        except KeyError:  # a setting kept on a class, not the instance: the pieces read it each call
            return cls(None, hc, reads.freeze(), [])
        for own in expert_reads:
            own.freeze()
        weights = None
        if (
            not reads.freeze().overridden
            and routed is None
            and fetch is None
            and hashed is None
            and gate_bias is not None
            and in_place(gate_weight)
            and gate_bias.dtype == torch.float32
            and 1 <= topk < 16
            and len(experts) == gate_weight.shape[0] + 1
            and all(lin.storage == "dense" for lin in linears)
            and all(w is not None and w.dtype == torch.float32 for w in dense)
            and norm_weight is not None
        ):
            weights = kernels.FfnWeights(
                entry_weights(kernels, cfg, hc, mix, norm_weight, eps), gate_weight, gate_bias, topk, normalize,
                scaling, dense[0::3], dense[1::3], dense[2::3], limits,
            )  # fmt: skip
        return cls(weights, hc, reads, expert_reads)


def entry_weights(
    kernels: ModuleType,
    cfg: ModelConfig,
    hc: HcWeights,
    mix: tuple[int, int, int],
    norm_weight: torch.Tensor,
    norm_eps: float,
) -> object:
    """A sublayer's mHC entry as the compiled ``EntryWeights`` (``hc_enter``'s arguments besides the rows): the
    layout ``hc``, the sublayer norm's weight and eps, the config's rms_eps, hc_eps and Sinkhorn iterations, the mix
    kernel's addresses ``mix`` (`kvdiet.model.sinkhorn.hc_mix_address`); and the forms in which the exit's product
    (``hc_expand_rows``' ``combᵀ · residual``, [B, hc, hc] · [B, hc, hidden]) runs as the compiled chain for one row
    and for more (`kvdiet.model.chain_products.chain_fits` at the current intra-op threads and matmul precision,
    which the kernel reads with them: ``torch.bmm`` runs where either has changed). The chain replaces a call of
    some 4 µs a sublayer (0.3 ms of a v4.1-mini decode step). Likewise the blocks in which the entry's coefficient
    product (``flatten(h) · fn_t``) runs as the compiled ``chain_mm`` for one row and for more
    (`kvdiet.model.chain_products.weight_block`; ``torch.mm`` where none or where the settings changed)."""
    hc_mult, hidden = cfg.hc_mult, cfg.hidden_size
    one, more = (chain_fits(hc_mult, hc_mult, hidden, True, False, single=single) for single in (True, False))
    entry_one, entry_more = weight_block(1, hc.fn_t), weight_block(None, hc.fn_t)
    return kernels.EntryWeights(
        hc.fn_t,
        hc.scale,
        hc.base,
        norm_weight,
        norm_eps,
        cfg.rms_norm_eps,
        cfg.hc_eps,
        cfg.hc_sinkhorn_iters,
        mix,
        int(one),
        int(more),
        entry_one,
        entry_more,
    )


def in_place(weight: torch.Tensor | None) -> bool:
    """A weight the compiled products read as `kvdiet.model.gemv.applies` lets them: contiguous fp32 on the CPU,
    not a lazily negated view."""
    return (
        weight is not None
        and weight.dtype == torch.float32
        and weight.is_cpu
        and weight.is_contiguous()
        and not weight.is_neg()
    )
