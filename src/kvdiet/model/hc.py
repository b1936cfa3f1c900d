"""mHC (manifold-constrained hyper-connections): the residual as ``hc_mult`` streams, as plain functions.

The transformer block owns the parameters (checkpoint names ``hc_attn_fn`` / ``hc_attn_scale`` /
``hc_attn_base`` and ``hc_ffn_*``) and decides which pre-mix feeds which sublayer (the V4.1 shift, v41-spec
§8.1); this module only computes coefficients and mixes streams. All math is fp32 (fp64 when the
streams are fp64, `kvdiet.model.layers.widen`); the Sinkhorn loop runs compiled (`kvdiet.model.sinkhorn`,
bit-identical to torch). A block's parameters are laid out for the computation once (`HcWeights`, kept
until a parameter changes), so a decode step's per-call work is the formula's own ops and nothing else.

Shapes: streams ``h`` [..., T, hc, hidden]; ``fn`` [(2+hc)·hc, hc·hidden]; ``scale`` [3]; ``base``
[(2+hc)·hc]; ``pre``/``post`` [..., T, hc]; ``comb`` [..., T, hc, hc]. The model uses no leading dims.
Source: v41-spec §8.1a (DeepSeek's V4.1 reference ``hc_pre`` / ``hc_post`` and the Sinkhorn normalisation).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from kvdiet.config import ModelConfig
from kvdiet.formats import native
from kvdiet.model.chain_products import ChainForm, chain_fits, weight_block
from kvdiet.model.layers import RMSNorm, as_dtype, constant, kernels_agree, widen
from kvdiet.model.member import member, overridden
from kvdiet.model.sinkhorn import MAX_MIX_ROWS, hc_mix, hc_mix_address, softmax_sinkhorn

__all__ = [
    "KERNEL_ROWS",
    "HcWeights",
    "add_sublayer_hc",
    "decode_kernels",
    "entry_kernels",
    "hc_coefficients",
    "hc_collapse",
    "hc_expand",
    "hc_init_streams",
    "hc_initial_pre",
    "hc_parameter_names",
    "sublayer_coefficients",
    "sublayer_entry",
    "sublayer_weights",
]


def add_sublayer_hc(block: nn.Module, cfg: ModelConfig) -> None:
    """Register a block's mHC parameters under DeepSeek's names: ``hc_{attn,ffn}_fn`` [(2+hc)·hc, hc·hidden]
    (zeros), ``hc_{attn,ffn}_base`` [(2+hc)·hc] (zeros), ``hc_{attn,ffn}_scale`` [3] (ones); and
    ``block.hc_weights``, an empty dict where `sublayer_coefficients` keeps each sublayer's `HcWeights`."""
    hc, mix = cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
    for part in ("attn", "ffn"):
        block.register_parameter(f"hc_{part}_fn", nn.Parameter(torch.zeros(mix, hc * cfg.hidden_size)))
        block.register_parameter(f"hc_{part}_base", nn.Parameter(torch.zeros(mix)))
        block.register_parameter(f"hc_{part}_scale", nn.Parameter(torch.ones(3)))
    block.hc_weights = {}


KERNEL_ROWS = 16
"""The most rows ``hc_enter`` and ``hc_expand_rows`` take unless asked for any number (``kHcRowsMax``: a batched
decode step's)."""

_NAMES = {part: (f"hc_{part}_fn", f"hc_{part}_scale", f"hc_{part}_base") for part in ("attn", "ffn")}


def hc_parameter_names(part: str) -> tuple[str, str, str]:
    """The names of the ``attn`` or ``ffn`` sublayer's mHC parameters on its block: (fn, scale, base)."""
    return _NAMES[part]


def sublayer_coefficients(
    block: nn.Module, cfg: ModelConfig, h: torch.Tensor, part: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_coefficients` of the ``attn`` or ``ffn`` sublayer of ``block`` (see `add_sublayer_hc`) for streams
    ``h`` [T, hc, hidden]; the same values, bit for bit.

    Without autograd the sublayer's `HcWeights` are kept in ``block.hc_weights[part]`` and rebuilt when a
    parameter is replaced (a new object, as the checkpoint loader does), moved or converted (``.to``,
    ``.double()``: new storage), or written in place through autograd's view of it (``copy_`` under
    ``no_grad``, ``load_state_dict``: its version counter); writes that skip the version counter (through
    ``.data``) are not seen. Parameters that are inference tensors (made under ``torch.inference_mode``) are
    laid out on every call, not cached.
    """
    return sublayer_weights(block, cfg, h, part).coefficients(
        h, rms_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters
    )


def sublayer_entry(
    block: nn.Module, cfg: ModelConfig, h: torch.Tensor, part: str, collapse_pre: torch.Tensor, norm: RMSNorm
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the ``attn`` or ``ffn`` sublayer of ``block`` takes from streams ``h`` [T, hc, hidden]: its input
    ``x = norm(hc_collapse(h, collapse_pre))`` (``collapse_pre`` [T, hc]: the pre-mix that feeds this sublayer,
    v41-spec §8.1) and its own `sublayer_coefficients` ``(pre, post, comb)``, the same values bit for bit.

    Where it applies (fp32 streams of at most `MAX_MIX_ROWS` rows on the CPU with hc ≤ 4, no autograd: a decode
    step's and a prefill chunk's) all of it is one compiled call (``hc_enter``: torch's ops and kernels in order,
    `hc_mix`'s included, the coefficients' product as ``chain_mm`` where `weight_block` finds torch's bits; it
    needs the norm kernel checked, `kvdiet.model.layers.kernels_agree`); elsewhere, the functions themselves.

    Returns:
        (x fp32 [T, hidden], pre [T, hc], post [T, hc], comb [T, hc, hc]).
    """
    weights = sublayer_weights(block, cfg, h, part)
    if (
        not torch.is_grad_enabled()
        and h.dtype == torch.float32
        and h.dim() == 3
        and h.shape[0] <= MAX_MIX_ROWS
        and not overridden(norm, RMSNorm)  # a hook or wrapper on the norm runs on the module path
    ):
        kernels, mix = entry_kernels()
        if kernels is not None and mix is not None and weights.dtype == torch.float32:
            entered = kernels.hc_enter(
                h, weights.fn_t, weights.scale, weights.base, collapse_pre, member(norm, "weight"), norm.eps,
                cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters, mix, any_rows=h.shape[0] > KERNEL_ROWS,
                mix_block=weight_block(h.shape[0], weights.fn_t),
            )  # fmt: skip
            if entered is not None:
                return entered
    return norm(hc_collapse(h, collapse_pre)), *weights.coefficients(
        h, rms_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters
    )


def entry_kernels() -> tuple[ModuleType | None, tuple[int, int, int] | None]:
    """The compiled kernels and `hc_mix_address` when ``hc_enter`` may run (built, not switched off, the norm
    kernel's bits checked), else (None, None)."""
    kernels = native.fp4_kernels()
    if kernels is None or not kernels_agree("rms_norm"):
        return None, None
    return kernels, hc_mix_address()


def decode_kernels(h: torch.Tensor) -> tuple[ModuleType, tuple[int, int, int]] | None:
    """(the compiled kernels, `hc_mix_address`) where a decode step's streams ``h`` may take a layer's compiled
    calls (`kvdiet.model.decode_layer`): no autograd, 1..`KERNEL_ROWS` fp32 rows on the CPU, `entry_kernels`."""
    if (
        torch.is_grad_enabled()
        or h.dtype != torch.float32
        or not h.is_cpu
        or not 1 <= h.shape[0] <= KERNEL_ROWS
    ):
        return None
    kernels, mix = entry_kernels()
    return None if kernels is None or mix is None else (kernels, mix)


def sublayer_weights(block: nn.Module, cfg: ModelConfig, h: torch.Tensor, part: str) -> HcWeights:
    """The `HcWeights` of ``block``'s ``part`` sublayer for streams ``h``, kept as `sublayer_coefficients` says."""
    fn_name, scale_name, base_name = _NAMES[part]
    fn, scale, base = member(block, fn_name), member(block, scale_name), member(block, base_name)
    dtype, grad = _compute_dtype(h), torch.is_grad_enabled()
    weights = block.hc_weights.get(part)
    # kept weights are never of inference tensors (below), so the same objects are not: `current` may read
    # their version counters
    if not grad and weights is not None and weights.current(fn, scale, base, dtype):
        return weights
    # the cached tensors are detached: gradients need the parameters themselves; inference tensors keep no
    # version counter, so an in-place write could not be seen
    weights = HcWeights.build(fn, scale, base, hc_mult=cfg.hc_mult, dtype=dtype)
    if not (grad or fn.is_inference() or scale.is_inference() or base.is_inference()):
        block.hc_weights[part] = weights
    return weights


def hc_coefficients(
    h: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    hc_mult: int,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pre, post and comb mixes of one sublayer from its input streams (v41-spec §8.1a).

    ``mixes = (flatten(h) · fnᵀ) · rsqrt(mean(h²) + rms_eps)`` with one statistic per token over the whole
    flattened hc·hidden vector; then ``pre = σ(mixes[:hc]·scale[0] + base[:hc]) + hc_eps``,
    ``post = 2σ(mixes[hc:2hc]·scale[1] + base[hc:2hc])``,
    ``comb = softmax_rows((mixes[2hc:]·scale[2] + base[2hc:]).view(hc, hc)) + hc_eps``, each column divided
    by (its sum + hc_eps), then (sinkhorn_iters − 1) × [rows /= row sum + hc_eps; columns /= column sum +
    hc_eps].

    Args:
        h: streams [..., T, hc, hidden], any float dtype (promoted to fp32).
        fn: [(2+hc)·hc, hc·hidden]; scale: [3]; base: [(2+hc)·hc] (promoted to fp32).
        hc_mult: config ``hc_mult``; rms_eps: config ``rms_norm_eps``; hc_eps: config ``hc_eps``;
        sinkhorn_iters: config ``hc_sinkhorn_iters`` (≥ 1).
    Returns:
        (pre [..., T, hc], post [..., T, hc], comb [..., T, hc, hc]), fp32. ``comb[j, i]`` weighs residual
        stream j into output stream i (see `hc_expand`).
    Raises:
        ValueError: shapes inconsistent with ``hc_mult``, or ``sinkhorn_iters < 1``.
    """
    weights = HcWeights.build(fn, scale, base, hc_mult=hc_mult, dtype=_compute_dtype(h))
    return weights.coefficients(h, rms_eps=rms_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters)


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    """fp64 for fp64 streams, else fp32 (`kvdiet.model.layers.widen`)."""
    return torch.float64 if h.dtype == torch.float64 else torch.float32


@dataclass(frozen=True, slots=True)
class HcWeights:
    """One sublayer's mHC parameters laid out for `hc_coefficients` in one compute dtype, built once: ``fn_t`` = fnᵀ
    [hc·hidden, (2+hc)·hc], ``scale`` [3], ``base`` [(2+hc)·hc] (views of the parameters when they have that dtype:
    a ``.data`` write, which no version counter sees, is read too); each mix's scale is taken at each use.

    ``source`` holds the parameters it was built from and ``stamp`` their (version, data pointer) pairs, for
    `current`; ``pinned`` holds detached views of their storage, so no later storage can take a pinned
    address while this object lives.
    """

    hc: int
    dtype: torch.dtype
    fn_t: torch.Tensor
    scale: torch.Tensor
    scale_index: torch.Tensor
    base: torch.Tensor
    source: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    stamp: tuple[int, int, int, int, int, int]
    pinned: tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    @classmethod
    def build(
        cls, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *, hc_mult: int, dtype: torch.dtype
    ) -> HcWeights:
        """Lay out ``fn`` [(2+hc)·hc, hc·hidden], ``scale`` [3], ``base`` [(2+hc)·hc] in ``dtype``.

        Raises:
            ValueError: shapes inconsistent with ``hc_mult``.
        """
        hc, n_mix = hc_mult, (2 + hc_mult) * hc_mult
        if (
            fn.dim() != 2
            or fn.shape[0] != n_mix
            or fn.shape[1] % hc
            or scale.shape != (3,)
            or base.shape != (n_mix,)
        ):
            raise ValueError(
                f"fn {tuple(fn.shape)}, scale {tuple(scale.shape)}, base {tuple(base.shape)} do not match "
                f"hc_mult={hc} (expected ({n_mix}, hc·hidden), (3,), ({n_mix},))"
            )
        index = torch.tensor([0] * hc + [1] * hc + [2] * hc * hc, device=scale.device)
        return cls(
            hc=hc,
            dtype=dtype,
            fn_t=as_dtype(fn, dtype).T,
            scale=as_dtype(scale, dtype),
            scale_index=index,
            base=as_dtype(base, dtype),
            source=(fn, scale, base),
            stamp=_stamp(fn, scale, base),
            pinned=(fn.detach(), scale.detach(), base.detach()),
        )

    def current(self, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether these are still the layout of ``fn``, ``scale``, ``base`` in ``dtype``: the same objects,
        storage and version counters (see `sublayer_coefficients` for what that covers)."""
        src = self.source
        return (
            src[0] is fn
            and src[1] is scale
            and src[2] is base
            and self.dtype == dtype
            and self.stamp == _stamp(fn, scale, base)
        )

    def mix_scales(self) -> torch.Tensor:
        """Each mix's scale [(2+hc)·hc] in ``dtype``: hc × scale[0], hc × scale[1], hc² × scale[2] (a new tensor)."""
        return self.scale.index_select(0, self.scale_index)

    def coefficients(
        self, h: torch.Tensor, *, rms_eps: float, hc_eps: float, sinkhorn_iters: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`hc_coefficients` of streams ``h`` [..., T, hc, hidden] (v41-spec §8.1a): (pre [..., T, hc], post
        [..., T, hc], comb [..., T, hc, hc]) in ``dtype``.

        Every step is the op of the straightforward formula on the same operands (in place where a
        temporary allows: the same kernel, the same roundings), so the values are those of the formula bit
        for bit; the pre, post and comb logits are each made contiguous as a tensor of their own, as
        sigmoid's and softmax's CPU kernels round an element by where it falls in a contiguous run.

        Raises:
            ValueError: ``h`` has not hc streams or not the hidden size of fn, or ``sinkhorn_iters < 1``.
        """
        hc = self.hc
        if h.dim() < 2 or h.shape[-2] != hc or hc * h.shape[-1] != self.fn_t.shape[0]:
            raise ValueError(
                f"h {tuple(h.shape)} does not match hc_mult={hc} and fn's hc·hidden={self.fn_t.shape[0]}"
            )
        if sinkhorn_iters < 1:
            raise ValueError(f"sinkhorn_iters must be >= 1, got {sinkhorn_iters}")
        dt = self.dtype
        flat = as_dtype(h, dt).flatten(-2)  # [..., T, hc·hidden]
        if flat.dim() == 2 and flat.shape[0] <= MAX_MIX_ROWS and not torch.is_grad_enabled():
            mixed = hc_mix(
                torch.matmul(flat, self.fn_t),
                flat.square().mean(-1),
                self.mix_scales(),
                self.base,
                rms_eps=rms_eps,
                hc_eps=hc_eps,
                iters=sinkhorn_iters,
            )
            if mixed is not None:  # the steps below in one compiled call, bit for bit
                return mixed
        rstd = flat.square().mean(-1, keepdim=True).add_(constant(rms_eps, dt)).rsqrt_()
        z = (
            torch.matmul(flat, self.fn_t).mul_(rstd).mul_(self.mix_scales()).add_(self.base)
        )  # [..., T, mixes]
        pre, post, comb = z.split_with_sizes((hc, hc, hc * hc), -1)
        pre = torch.sigmoid(pre.contiguous()).add_(constant(hc_eps, dt))
        post = torch.sigmoid(post.contiguous())
        post = post.add_(post)  # 2·σ, exactly
        comb = softmax_sinkhorn(comb.view(*z.shape[:-1], hc, hc), eps=hc_eps, iters=sinkhorn_iters)
        return pre, post, comb


def _stamp(fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """(version, data pointer) of each parameter: an in-place write through autograd bumps the first, a
    replaced storage changes the second. An inference tensor keeps no version counter: −1
    (`sublayer_coefficients` does not cache those)."""
    try:
        return (fn._version, fn.data_ptr(), scale._version, scale.data_ptr(), base._version, base.data_ptr())
    except RuntimeError:  # "Inference tensors do not track version counter"
        pairs = [(-1 if t.is_inference() else t._version, t.data_ptr()) for t in (fn, scale, base)]
        return (*pairs[0], *pairs[1], *pairs[2])


def hc_collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Sublayer input ``Σ_i pre_i · h_i``.

    h: [..., T, hc, hidden], pre: [..., T, hc] -> fp32 [..., T, hidden].
    """
    h = widen(h)
    return (as_dtype(pre, h.dtype).unsqueeze(-1) * h).sum(-2)


def hc_expand(
    x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """New streams after a sublayer: stream i = ``post_i · x + Σ_j comb[j, i] · residual_j`` (v41-spec §8.1a).

    Args:
        x: sublayer output [..., T, hidden]; residual: input streams [..., T, hc, hidden];
        post: [..., T, hc]; comb: [..., T, hc, hc].
    Returns:
        fp32 [..., T, hc, hidden].

    fp32 CPU rows (any number, ``any_rows``: a decode step's and a prefill's; no autograd) run in one compiled call
    (``hc_expand_rows``, ``formats/hc_kernels.cpp``: the same ``bmm``, or for a prefill's rows (more than
    `KERNEL_ROWS`) and contiguous operands its compiled twin where `kvdiet.model.chain_products.chain_fits` finds a
    form that matches at this shape, then each element's multiply and add), with the same bits; it declines NaN
    outputs.
    """
    if not torch.is_grad_enabled() and residual.dim() == 3:
        kernels = native.fp4_kernels()
        out = None
        if kernels is not None:
            # the chain's class: a contiguous combᵀ and residual (hc_expand_rows checks the layout)
            rows, hc, hidden = residual.shape
            form = ChainForm.NONE
            if rows > KERNEL_ROWS and residual.is_cpu and residual.dtype == torch.float32:
                # not a decode step's rows: at::bmm is as fast there, without the check's Python
                form = chain_fits(hc, hc, hidden, True, False)
            out = kernels.hc_expand_rows(
                x, residual, post, comb, any_rows=True, chain=bool(form), **form.kernel_flags
            )
        if out is not None:
            return out
    residual = widen(residual)
    dt = residual.dtype
    comb_t = as_dtype(comb, dt).transpose(-1, -2)
    # [..., T, hc, hidden]; row i = Σ_j comb[j,i]·r_j. torch.matmul passes two 3-d operands with one batch size
    # to bmm unchanged, so bmm itself gives the same bits without matmul's expand and reshape calls
    if comb_t.dim() == 3 and residual.dim() == 3 and comb_t.shape[0] == residual.shape[0]:
        mixed = torch.bmm(comb_t, residual)
    else:
        mixed = comb_t @ residual
    return (as_dtype(post, dt).unsqueeze(-1) * as_dtype(x, dt).unsqueeze(-2)).add_(mixed)


def hc_init_streams(x: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """Copy the embedding output into every stream: x [..., T, hidden] -> fp32 [..., T, hc_mult, hidden]."""
    x = widen(x)
    return x[..., None, :].expand(*x.shape[:-1], hc_mult, x.shape[-1]).clone()


def hc_initial_pre(num_tokens: int, hc_mult: int) -> torch.Tensor:
    """Block 0's previous pre-mix: one-hot on stream 0, fp32 [num_tokens, hc_mult] (v41-spec §8.1)."""
    pre = torch.zeros(num_tokens, hc_mult, dtype=torch.float32)
    pre[:, 0] = 1.0
    return pre
