"""`StepBindings`: every layer's decode bindings (`AttnBinding`, `FfnBinding`) checked once per decode step, in a
few C loops over all of them (``formats/reads_kernels.cpp``), instead of layer by layer.

A layer's own checks (`AttnBinding.holds`, `FfnBinding.holds` and `FfnBinding.routed_current`, with
`kvdiet.model.hc.sublayer_weights` for its mHC layout) cost some 25 µs a layer in a running step, cold: on
v4.1-mini about 1 ms of a 15-16 ms 4K step; the same reads for all layers at once, some 0.25 ms (in Python's
``map`` passes, as they were before the C loops, 1.2 ms of a 19 ms step on a shared machine). What is checked
is what the layers check: every read of every binding (`ModuleReads`), every routed expert's included (a layer on
its own checks only those a call routed to, after the call), each block still holding those bindings and keeping
the `HcWeights` they hold, each sublayer's mHC parameters still the ones those were built from, with the same
version counters and storage (`HcWeights.current`), and the model's layers still the blocks gathered, each exactly a
`Block`. What the step itself must satisfy (the compiled kernels on, 1..16 fp32 CPU rows, no autograd, nothing the
pieces call patched: `kvdiet.model.block.pieces_unpatched`) is checked by `step_kernels`. The check is made before
the step: a change made during it (by a hook of a module the step still calls, an Engram's, say) is not seen, nor
one to a layer's codecs or compressor, read then for its inputs (`kvdiet.model.decode_layer.prepare_step`).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from kvdiet.formats import native
from kvdiet.model.block import pieces_unpatched
from kvdiet.model.hc import decode_kernels, hc_parameter_names
from kvdiet.model.module_reads import ModuleReads, Transient

__all__ = ["StepBindings", "step_kernels"]


class StepBindings(Transient):
    """The bindings of every layer of a model, as one `ModuleReads` (``reads``) and the mHC parameters their
    `HcWeights` were built from (``params``) with their version counters and data pointers, one after the other
    (``stamps``: ``[version_0, data_ptr_0, version_1, ...]``, as `HcWeights.stamp`)."""

    __slots__ = ("params", "reads", "stamps")

    def __init__(self, reads: ModuleReads, params: list[torch.Tensor], stamps: list[int]) -> None:
        self.reads, self.params, self.stamps = reads, params, stamps

    @classmethod
    def gather(cls, model: nn.Module) -> StepBindings | None:
        """The bindings ``model``'s blocks hold now, or None unless every block holds both, each with compiled
        weights (a layer the compiled calls do not fit checks its own, step by step)."""
        parts, params, stamps = [], [], []
        top = ModuleReads()
        layers = top.read(model._modules, "layers")
        for key, block in layers._modules.items():
            attn, ffn = block.__dict__.get("attn_binding"), block.__dict__.get("ffn_binding")
            if attn is None or ffn is None or attn.weights is None or ffn.weights is None:
                return None
            own = ModuleReads()
            own.expect(layers._modules, key, block)
            own.of_class(block)
            for name, binding in (("attn_binding", attn), ("ffn_binding", ffn)):
                own.expect(block.__dict__, name, binding)
            kept = own.read(block.__dict__, "hc_weights")
            for part, hc in (("attn", attn.hc), ("ffn", ffn.hc)):
                # the layout the pieces would use (`kvdiet.model.hc.sublayer_weights`)
                own.expect(kept, part, hc)
                for name, param in zip(hc_parameter_names(part), hc.source, strict=True):
                    own.expect(block._parameters, name, param)
                params += hc.source
                stamps += hc.stamp
            parts += [attn.reads, ffn.reads, *ffn.experts, own.freeze()]
        return cls(ModuleReads.joined([top.freeze(), *parts]), params, stamps)

    def holds(self) -> bool:
        """Whether every layer's bindings still hold (see the module docstring); the parameters' stamps read in a C
        loop (``stamps_hold``); never without the compiled kernels (`ModuleReads.holds`)."""
        kernels = native.fp4_kernels()
        return kernels is not None and self.reads.holds() and kernels.stamps_hold(self.params, self.stamps)


def step_kernels(model: nn.Module, h: torch.Tensor) -> ModuleType | None:
    """The compiled kernels when every layer of ``model`` (a `kvdiet.model.transformer.Transformer`) may take its
    bound calls this decode step without checking its own bindings: the step's streams ``h`` fit them and the
    model's `StepBindings` (gathered again where missing) hold; else None (each layer checks its own)."""
    got = decode_kernels(h)
    if got is None or not pieces_unpatched():
        return None
    bindings = model.__dict__.get("step_bindings")
    if bindings is None or not bindings.holds():
        bindings = model.__dict__["step_bindings"] = StepBindings.gather(model)
        if bindings is None or not bindings.holds():
            return None
    return got[0]
