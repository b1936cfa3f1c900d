"""A decode step's layer (one row per request) after its Engram: the attention sublayer over the whole batch,
then the FFN half.

Where the layer's weights are bound (`kvdiet.model.attn_binding.AttnBinding`, `kvdiet.model.ffn_binding.FfnBinding`:
1..16 fp32 CPU rows, no autograd, dense fp32 weights, exact module classes, no hooks, no selection observer) the
layer is three compiled calls around its cache reads (``formats/layer_kernels.cpp``): ``attn_head`` (mHC entry,
query and window-KV projections, then on a layer without a compressor its window read: ``read_fp8_window``, as
`kvdiet.formats.fp8.read_window` calls it), `kvdiet.model.decode_step.attend_inputs` in Python (the KV-source
layer's new global entries, its window read, or where the fused read declined the layer's, the indexer's top-k,
the gather of the selected entries), then ``attn_tail``
(attention, output projection, mHC exit, and the whole FFN half): the kernels the pieces call, in their order, on
the same operands, so the same bits. On v4.1-mini that leaves some 40 Python calls a layer of the ~190 the pieces
make. Elsewhere, or where a kernel declines, the pieces run: `Block.entry`, the `Attention` module (its hooks
included), `hc_expand`, `Block.ffn_half`. A binding keeps the tensors it bound alive until its layer binds again:
weights replaced after a decode step stay in memory until the next one.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from kvdiet.formats import fp8
from kvdiet.model.attn_binding import AttnBinding
from kvdiet.model.decode_ffn import bound_ffn, bound_sublayer
from kvdiet.model.decode_step import DecodePlan, attend_inputs, attend_out
from kvdiet.model.ffn_binding import FfnBinding
from kvdiet.model.hc import hc_expand
from kvdiet.model.layers import Rotation, rope_kernels
from kvdiet.model.segment import Segment
from kvdiet.model.step_bindings import step_kernels

__all__ = ["decode_layer", "prepare_step"]


def prepare_step(model: nn.Module, plan: DecodePlan, h: torch.Tensor) -> ModuleType | None:
    """`step_kernels` for a decode step's streams ``h`` fp32 [B, hc, hidden] (every layer's bindings checked at
    once), and where they hold, every bound layer's rotation and window-read arguments (`_prepare`) made at once into
    ``plan.prepared``. Made layer by layer, between compiled calls that stream each layer's weights and caches
    through the CPU's caches, those few Python lines ran cold: some 21 µs a layer in a v4.1-mini step at 1M context
    (2 µs hot), against some 5 µs a layer in this loop; paired in one process, a 4K step 0.53-0.64 ms faster (38 and
    36 of 40 rounds); at 1M 0.59 ms (28 of 40) once, and the medians level (faster in 27 of 40 rounds) once."""
    kernels = step_kernels(model, h)
    for block in () if kernels is None else model._modules["layers"]:
        binding = block.__dict__["attn_binding"]
        plan.prepared[binding.attn.info.layer_id] = _prepare(binding, plan, h.shape[0])  # None: the pieces
    return kernels


def decode_layer(
    block: nn.Module,
    h: torch.Tensor,
    prev_pre: torch.Tensor,
    segs: list[Segment],
    plan: DecodePlan,
    checked: ModuleType | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention sublayer and FFN half of ``block`` (a `kvdiet.model.block.Block`) on a decode step's streams.

    Args:
        h: streams fp32 [B, hc, hidden], one row per request of ``segs``; prev_pre: the pre-mix that feeds this
            attention sublayer [B, hc] (the previous FFN's, v41-spec §8.1); plan: the step's `DecodePlan`;
            checked: `prepare_step`'s kernels where the model's `StepBindings` held for this step (the layer's
            bindings are not checked again, and its inputs are those `prepare_step` made into ``plan``).
    Returns:
        (new streams [B, hc, hidden], this FFN's pre [B, hc]), the bits of the pieces.
    Raises:
        ValueError: as `kvdiet.model.decode_step.decode_attention`.
    """
    done = _bound_layer(block, h, prev_pre, segs, plan, checked)
    if done is not None:
        return done
    x, attn_pre, post, comb = block.entry(h, "attn", prev_pre)
    out = block._modules["attn"](x, segs, plan)  # no nn.Module attribute fallback (a microsecond)
    return block.ffn_half(hc_expand(out, h, post, comb), attn_pre, decode_step=True)


def _bound_layer(
    block: nn.Module,
    h: torch.Tensor,
    prev_pre: torch.Tensor,
    segs: list[Segment],
    plan: DecodePlan,
    checked: ModuleType | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`decode_layer` through the layer's bindings (bound again where the modules changed, unless ``checked``), or
    None where they do not apply or ``attn_head`` declines (nothing is computed or written then)."""
    if checked is not None:
        kernels, binding = checked, block.__dict__["attn_binding"]
        ffn: FfnBinding | None = block.__dict__["ffn_binding"]
    else:
        bound = bound_sublayer(block, h, "attn", AttnBinding)
        if bound is None:
            return None
        kernels, binding = bound
        ffn = None if (got := bound_ffn(block, h)) is None else got[1]
    attn = binding.attn
    made = plan.prepared[attn.info.layer_id] if checked is not None else _prepare(binding, plan, h.shape[0])
    if made is None:
        return None
    rot, window = made
    head = kernels.attn_head(h, prev_pre, binding.weights, rot.cis, *window)
    if not head:
        return None
    x, attn_pre, post, comb, qr, q, kv, *read = head
    win_kv, win_mask, comp, comp_mask = attend_inputs(
        attn, x, qr, q, kv, segs, plan, rot, tuple(read) or None
    )
    args = (q, win_kv, win_mask, comp, comp_mask, h, post, comb, attn_pre, rot.cis_inverse, binding.weights)
    tail = kernels.attn_tail(*args, None if ffn is None else ffn.weights)
    if len(tail) == 3 and (checked is not None or ffn.routed_current(tail[2])):
        return tail[0], tail[1]
    if len(tail) == 3:
        # a routed expert changed since it was bound: the attention again, the FFN's pieces then
        block.__dict__["ffn_binding"] = None
        tail = kernels.attn_tail(*args, None)
    if not tail:  # the attention's kernels declined (or its inputs do not fit: the pieces raise the error)
        tail = [hc_expand(attend_out(attn, q, win_kv, win_mask, comp, comp_mask, rot), h, post, comb)]
    return block.ffn_half(tail[0], attn_pre, decode_step=True)


def _prepare(binding: AttnBinding, plan: DecodePlan, rows: int) -> tuple[Rotation, tuple] | None:
    """A bound layer's rotation (`DecodePlan.rotation` of its RoPE) and its `_fused_window` arguments for ``rows``
    requests, or None where that rotation does not fit the layer's compiled calls."""
    attn = binding.attn
    rot = plan.rotation(attn.rope)
    if rot.rope_dim != binding.rope_dim or rope_kernels(rot.rope_dim) is None:
        return None
    return rot, _fused_window(attn, plan, rows)


def _fused_window(attn: nn.Module, plan: DecodePlan, rows: int) -> tuple:
    """``attn_head``'s window-read arguments for this layer (`kvdiet.formats.fp8.read_window`'s: the rings, slots and
    held slots, scale-byte range, the plan's key buffer and the entries to stage), so the read runs in the same call
    as the projections; ``()`` where `attend_inputs`' own read must run: a layer with a compressor (its step and its
    checks come first), or a window codec other than the FP8 one."""
    codec = attn.codecs.window
    if attn._modules.get("compressor") is not None or codec.fused_read is not fp8.read_window:
        return ()
    keys = plan.key_buffer(codec.dim)  # the step's one key buffer (a bound layer runs without autograd)
    layer = attn.info.layer_id
    held = None if plan.window_held is None else plan.window_held[layer]
    entries = torch.empty(rows, codec.width, dtype=torch.uint8)
    return plan.layer_rings[layer], plan.window_slots, held, *fp8.SCALE_BYTES, keys, entries
