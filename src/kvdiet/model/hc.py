"""mHC (manifold-constrained hyper-connections): the residual as ``hc_mult`` streams, as plain functions.

The transformer block owns the parameters (checkpoint names ``hc_attn_fn`` / ``hc_attn_scale`` /
``hc_attn_base`` and ``hc_ffn_*``) and decides which pre-mix feeds which sublayer (the V4.1 shift, v41-spec
§8.1); this module only computes coefficients and mixes streams. All math is fp32 (fp64 when the
streams are fp64, `kvdiet.model.layers.widen`); the Sinkhorn loop runs compiled (`kvdiet.model.sinkhorn`,
bit-identical to torch).

Shapes: streams ``h`` [..., T, hc, hidden]; ``fn`` [(2+hc)·hc, hc·hidden]; ``scale`` [3]; ``base``
[(2+hc)·hc]; ``pre``/``post`` [..., T, hc]; ``comb`` [..., T, hc, hc]. The model uses no leading dims.
Source: v41-spec §8.1a (DeepSeek's V4.1 reference ``hc_pre`` / ``hc_post`` and the Sinkhorn normalisation).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from kvdiet.config import ModelConfig
from kvdiet.model.layers import as_dtype, constant, widen
from kvdiet.model.sinkhorn import sinkhorn_

__all__ = [
    "add_sublayer_hc",
    "hc_coefficients",
    "hc_collapse",
    "hc_expand",
    "hc_init_streams",
    "hc_initial_pre",
    "sublayer_coefficients",
]


def add_sublayer_hc(block: nn.Module, cfg: ModelConfig) -> None:
    """Register a block's mHC parameters under DeepSeek's names: ``hc_{attn,ffn}_fn`` [(2+hc)·hc, hc·hidden]
    (zeros), ``hc_{attn,ffn}_base`` [(2+hc)·hc] (zeros), ``hc_{attn,ffn}_scale`` [3] (ones)."""
    hc, mix = cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
    for part in ("attn", "ffn"):
        block.register_parameter(f"hc_{part}_fn", nn.Parameter(torch.zeros(mix, hc * cfg.hidden_size)))
        block.register_parameter(f"hc_{part}_base", nn.Parameter(torch.zeros(mix)))
        block.register_parameter(f"hc_{part}_scale", nn.Parameter(torch.ones(3)))


def sublayer_coefficients(
    block: nn.Module, cfg: ModelConfig, h: torch.Tensor, part: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_coefficients` of the ``attn`` or ``ffn`` sublayer of ``block`` (see `add_sublayer_hc`) for streams
    ``h`` [T, hc, hidden]."""
    return hc_coefficients(
        h,
        getattr(block, f"hc_{part}_fn"),
        getattr(block, f"hc_{part}_scale"),
        getattr(block, f"hc_{part}_base"),
        hc_mult=cfg.hc_mult,
        rms_eps=cfg.rms_norm_eps,
        hc_eps=cfg.hc_eps,
        sinkhorn_iters=cfg.hc_sinkhorn_iters,
    )


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
    hc = hc_mult
    if h.shape[-2] != hc:
        raise ValueError(f"h has {h.shape[-2]} streams, expected hc_mult={hc}")
    n_mix = (2 + hc) * hc
    if fn.shape != (n_mix, hc * h.shape[-1]) or scale.shape != (3,) or base.shape != (n_mix,):
        raise ValueError(
            f"fn {tuple(fn.shape)}, scale {tuple(scale.shape)}, base {tuple(base.shape)} do not match "
            f"hc_mult={hc}, hidden={h.shape[-1]} (expected ({n_mix}, {hc * h.shape[-1]}), (3,), ({n_mix},))"
        )
    if sinkhorn_iters < 1:
        raise ValueError(f"sinkhorn_iters must be >= 1, got {sinkhorn_iters}")
    flat = widen(h).flatten(-2)  # [..., T, hc·hidden]
    dt = flat.dtype
    fn, scale, base = as_dtype(fn, dt), as_dtype(scale, dt), as_dtype(base, dt)
    rstd = torch.rsqrt(flat.square().mean(-1, keepdim=True).add_(constant(rms_eps, dt)))
    mixes = (flat @ fn.T) * rstd  # [..., T, n_mix]
    # every mix times its part's scale, plus its base, in two ops (the same products and sums per element);
    # each part made contiguous as a tensor of its own: sigmoid's and softmax's CPU kernels round an element
    # by where it falls in a contiguous run
    z = mixes * scale.index_select(0, _scale_index(hc, scale.device)) + base
    pre = torch.sigmoid(z[..., :hc].contiguous()).add_(constant(hc_eps, dt))
    post = torch.sigmoid(z[..., hc : 2 * hc].contiguous())
    post = post.add_(post)  # 2·σ, exactly
    comb = torch.softmax(z[..., 2 * hc :].contiguous().view(*z.shape[:-1], hc, hc), dim=-1)
    sinkhorn_(comb, eps=hc_eps, iters=sinkhorn_iters)
    return pre, post, comb


@functools.cache
def _scale_index(hc: int, device: torch.device) -> torch.Tensor:
    """int64 [(2+hc)·hc]: which of the 3 scales each mix takes (hc × 0, hc × 1, hc² × 2); built once."""
    return torch.tensor([0] * hc + [1] * hc + [2] * hc * hc, device=device)


def hc_collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Sublayer input ``Σ_i pre_i · h_i``.

    h: [..., T, hc, hidden], pre: [..., T, hc] -> fp32 [..., T, hidden].
    """
    h = widen(h)
    return (as_dtype(pre, h.dtype)[..., None] * h).sum(-2)


def hc_expand(
    x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """New streams after a sublayer: stream i = ``post_i · x + Σ_j comb[j, i] · residual_j`` (v41-spec §8.1a).

    Args:
        x: sublayer output [..., T, hidden]; residual: input streams [..., T, hc, hidden];
        post: [..., T, hc]; comb: [..., T, hc, hc].
    Returns:
        fp32 [..., T, hc, hidden].
    """
    residual = widen(residual)
    dt = residual.dtype
    mixed = as_dtype(comb, dt).transpose(-1, -2) @ residual  # [..., T, hc, hidden]; row i = Σ_j comb[j,i]·r_j
    return as_dtype(post, dt)[..., None] * as_dtype(x, dt)[..., None, :] + mixed


def hc_init_streams(x: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """Copy the embedding output into every stream: x [..., T, hidden] -> fp32 [..., T, hc_mult, hidden]."""
    x = widen(x)
    return x[..., None, :].expand(*x.shape[:-1], hc_mult, x.shape[-1]).clone()


def hc_initial_pre(num_tokens: int, hc_mult: int) -> torch.Tensor:
    """Block 0's previous pre-mix: one-hot on stream 0, fp32 [num_tokens, hc_mult] (v41-spec §8.1)."""
    pre = torch.zeros(num_tokens, hc_mult, dtype=torch.float32)
    pre[:, 0] = 1.0
    return pre
