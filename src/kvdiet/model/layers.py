"""RMSNorm and rotary position embedding (RoPE) of the V4.1 reference model, in fp32.

`RMSNorm` is the model's only norm (eps = config ``rms_norm_eps``, 1e-20 for V4.1, v41-spec §10). `Rope` is a
small frozen per-layer object: ratio > 0 layers use base ``compress_rope_theta`` with YaRN, ratio 0 layers use
base ``rope_theta`` without it (v41-spec §2). Angles are computed on the fly from absolute positions, so no
table sized by ``max_position_embeddings`` exists and 1M positions cost nothing extra; `Rope.at` computes them
once for every tensor rotated at the same positions (`Rotation`). This module knows
nothing about which vectors get rotated; attention and the indexer decide that.

A decode step's rows and a prefill's (fp32, on the CPU, no gradient to track) run in compiled kernels, ``rms_norm``
(``formats/rmsnorm_kernels.cpp``) and ``rope_rotate`` (``formats/rope_kernels.cpp``): one call instead of six to ten
torch ops of 5-15 µs dispatch each, with the torch formula's bits (`RMSNorm.forward` and `Rotation.apply` say
which inputs; the kernels decline any other, and any output with a NaN: which NaN torch's product of two NaNs
keeps depends on the element's place in its loop and on its compiler). Each kernel is checked against the torch
formula once per process on adversarial inputs (`kernels_agree`); a mismatch logs one warning and keeps the torch
formula. ``KVDIET_NATIVE_KERNELS=0`` (read on every call) or a failed build selects the
torch formulas too.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from kvdiet.config import ModelConfig
from kvdiet.formats import native
from kvdiet.model.member import stands_in
from kvdiet.model.yarn import rope_frequencies

__all__ = [
    "NORM_ROWS_MAX",
    "ROPE_ROWS_MAX",
    "WIDTH_MAX",
    "RMSNorm",
    "Rope",
    "Rotation",
    "as_dtype",
    "constant",
    "kernels_agree",
    "rope_kernels",
    "widen",
]

NORM_ROWS_MAX = 16
"""The most rows the compiled ``rms_norm`` takes unless asked for any number (``any_rows``, as `RMSNorm` asks: a
prefill's rows too; the kernel's ``kNormRowsMax``, a batched decode step of up to 16 requests), each of at most
`WIDTH_MAX` floats."""
ROPE_ROWS_MAX = 256
"""The most rows the compiled ``rope_rotate`` takes unless asked for any (``any_rows``, `Rotation.apply` says when;
``kRopeRowsMax``: a decode step of 16 requests' queries of up to 16 heads), each of at most `WIDTH_MAX` floats."""
WIDTH_MAX = 8192
"""The widest last dim either compiled kernel takes (``kNormDimMax``, ``kRopeWidthMax``)."""
_F32 = torch.float32
_log = logging.getLogger(__name__)


def widen(x: torch.Tensor) -> torch.Tensor:
    """``x`` in its compute dtype: fp32 for fp32 and narrower floats (bf16, fp16), fp64 kept as fp64. The model
    computes in fp32 as DeepSeek's reference does; a model converted to fp64 (``model.double()``, as the peer tests
    against transformers run it) computes in fp64 throughout instead."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, skipping the call (about a microsecond) when ``x`` already has that dtype."""
    return x if x.dtype == dtype else x.to(dtype)


@functools.cache
def constant(value: float, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``value`` as a 0-dim tensor of ``dtype`` on ``device``, built once (read-only: never modify it).

    ``t + constant(v, t.dtype)`` equals ``t + v`` bit for bit on any device (torch turns the Python float into
    a 0-dim tensor of ``t``'s dtype first, on every call) at half the cost of a tiny op. A CPU constant serves
    arithmetic on any device; ops that take no CPU scalars (``torch.polar``) need one on their own device.
    """
    with torch.inference_mode(False):  # an ordinary tensor: usable with and without autograd
        return torch.tensor(value, dtype=dtype, device=device)


@stands_in
class RMSNorm(nn.Module):
    """``y = x · rsqrt(mean(x²) + eps) · weight`` over the last dim, computed and returned in fp32.

    Args:
        dim: size of the normalised (last) dim; the parameter ``weight`` is fp32 [dim], initialised to ones.
        eps: config ``rms_norm_eps`` (1e-20 for V4.1, so an all-zero input gives NaN-free zeros only
            because 0 · rsqrt(1e-20) = 0).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] any float dtype -> [..., dim] in its compute dtype (`widen`: fp32, or fp64).

        The compiled ``rms_norm`` runs an fp32 ``x`` with no gradient to track when it fits: ``x`` contiguous on
        the CPU, any number of rows (``any_rows``: its one row-count-dependent step is torch's own ``at::sum`` on
        the formula's shape), 1 ≤ dim ≤ `WIDTH_MAX`, neither ``x`` nor ``weight`` a lazy negative view, and no
        output is NaN; it returns a new contiguous tensor with the torch formula's bits.
        """
        if x.dtype == torch.float32 and x.is_cpu and _untracked(x, self.weight):
            kernels = _checked_kernels("rms_norm")
            out = None if kernels is None else kernels.rms_norm(x, self.weight, self.eps, any_rows=True)
            if out is not None:  # else it does not fit, or an output is NaN
                return out
        return _torch_rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


@dataclass(frozen=True, slots=True)
class Rope:
    """Rotary embedding on interleaved adjacent pairs ``(x[2i], x[2i+1])`` of the last ``rope_dim`` dims.

    Attributes:
        rope_dim: d, config ``qk_rope_head_dim`` (64 for V4.1).
        base: the RoPE base actually used (``rope_theta`` or ``compress_rope_theta``).
        yarn: whether YaRN blending was applied to the frequencies.
        freqs: fp32 [d/2], radians per position of pair i (see `rope_frequencies`). Do not mutate.
    """

    rope_dim: int
    base: float
    yarn: bool
    freqs: torch.Tensor

    @classmethod
    def for_layer(cls, cfg: ModelConfig, compress_ratio: int) -> Rope:
        """The table of a layer with ``compress_ratios[l] = compress_ratio`` (v41-spec §2, "RoPE table").

        ratio > 0: base ``compress_rope_theta`` (160000), YaRN from ``rope_scaling`` when it is set and
        ``max_position_embeddings > rope_scaling.original_max_position_embeddings``. ratio 0: base
        ``rope_theta`` (10000), never YaRN. The same table serves q, window k, compressed k, index q and k.
        """
        scaling = cfg.rope_scaling
        if compress_ratio > 0:
            base = cfg.compress_rope_theta
            yarn = (
                scaling is not None and cfg.max_position_embeddings > scaling.original_max_position_embeddings
            )
        else:
            base, yarn = cfg.rope_theta, False
        if yarn:
            assert scaling is not None
            freqs = rope_frequencies(
                cfg.qk_rope_head_dim,
                base,
                factor=scaling.factor,
                original_max_position_embeddings=scaling.original_max_position_embeddings,
                beta_fast=scaling.beta_fast,
                beta_slow=scaling.beta_slow,
                yarn=True,
            )
        else:
            freqs = rope_frequencies(cfg.qk_rope_head_dim, base)
        return cls(rope_dim=cfg.qk_rope_head_dim, base=base, yarn=yarn, freqs=freqs)

    def at(self, positions: torch.Tensor) -> Rotation:
        """The rotations by ``positions · freqs``, computed once for any number of tensors (`Rotation.apply`).

        Args:
            positions: int64 absolute positions, broadcastable to the rotated tensors' ``shape[:-1]`` (e.g.
                [T] for x [..., T, D], or [T, 1] for x [T, H, D]). Angles are ``positions·freqs`` in fp32, as
                DeepSeek's reference table (``torch.outer`` of fp32 positions and freqs) computes them, on
                ``positions``' device.
        """
        freqs = self.freqs if self.freqs.device == positions.device else self.freqs.to(positions.device)
        angles = positions.to(torch.float32).unsqueeze(-1) * freqs  # [..., T, d/2]
        cis = torch.polar(constant(1.0, torch.float32, angles.device), angles)
        return Rotation(self.rope_dim, cis, cis.conj().resolve_conj())

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
        """Rotate the last ``rope_dim`` dims of ``x`` [..., T, D] by ``positions · freqs`` (by −angle when
        ``inverse``): ``self.at(positions).apply(x, inverse=inverse)``, a new tensor of ``x``'s shape, strides and
        dtype (see `at` and `Rotation.apply`).

        Raises:
            ValueError: ``x`` has fewer than ``rope_dim`` dims in its last axis.
        """
        _check_width(x, self.rope_dim)
        return self.at(positions).apply(x, inverse=inverse)


@dataclass(frozen=True, slots=True)
class Rotation:
    """A `Rope`'s rotations at fixed positions (`Rope.at`): the layers of one step that share a RoPE table and
    the step's positions rotate by one `Rotation` instead of recomputing its angles on every call.

    Attributes:
        rope_dim: d, the rotated trailing dims.
        cis: complex64 [..., T, d/2], ``polar(1, positions·freqs)``; ``cis_inverse`` its conjugate (stored
            resolved: the product reads it as is). Do not mutate.
    """

    rope_dim: int
    cis: torch.Tensor
    cis_inverse: torch.Tensor

    def apply(self, x: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
        """Rotate the last ``rope_dim`` dims of ``x`` (by −angle when ``inverse``).

        Args:
            x: [..., T, D] with D ≥ rope_dim, any float dtype, ``shape[:-1]`` broadcastable with the positions;
                dims ``[0, D − rope_dim)`` pass through.
            inverse: rotate by −angle; undoes the query-position rotation of the attention output (§2).
        Returns:
            A new tensor, same shape, strides and dtype as ``x`` (the rotation itself runs in fp32 complex
            arithmetic, like the reference ``apply_rotary_emb``; in fp64 for an fp64 ``x``). The compiled
            ``rope_rotate`` computes it, with the torch formula's bits, for an fp32 ``x`` with no gradient to
            track that fits: on the CPU, last stride 1, at most 6 dims, rows of at most `WIDTH_MAX`: any number
            (a prefill's) while torch runs one thread, else 1..`ROPE_ROWS_MAX` and under 32768 (GRAIN_SIZE) pairs
            (torch splits more over its threads, its scalar tail then where no check looks: its bits vary with the
            thread count); ``rope_dim`` not a multiple of 32 only where `rope_kernels` allows it;
            ``cis`` on the CPU, last stride 1, its leading dims each 1 or ``x``'s; neither a lazy conjugate or
            negative view (``cis.conj()``); no output NaN.
        Raises:
            ValueError: ``x`` has fewer than ``rope_dim`` dims in its last axis.
        """
        _check_width(x, self.rope_dim)
        cis = self.cis_inverse if inverse else self.cis
        if x.dtype == torch.float32 and x.is_cpu and _untracked(x, cis):
            kernels = rope_kernels(self.rope_dim)
            one = torch.get_num_threads() == 1  # torch's loop unsplit: its tails where `kernels_agree` looks
            out = None if kernels is None else kernels.rope_rotate(x, cis, self.rope_dim, one)
            if out is not None:  # else it does not fit, or an output is NaN
                return out
        return _torch_rotate(x, cis, self.rope_dim)


def _check_width(x: torch.Tensor, rope_dim: int) -> int:
    """``x``'s last dim; raises ValueError when it is smaller than ``rope_dim``."""
    width = x.shape[-1]
    if width < rope_dim:
        raise ValueError(f"last dim {width} is smaller than rope_dim {rope_dim}")
    return width


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm.forward`'s formula in torch ops."""
    x = widen(x)
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True).add_(constant(eps, x.dtype))) * weight


def _torch_rotate(x: torch.Tensor, cis: torch.Tensor, d: int) -> torch.Tensor:
    """`Rotation.apply`'s formula in torch ops: the last ``d`` dims of ``x`` times ``cis`` (complex64)."""
    width = x.shape[-1]
    if x.dtype == torch.float64:  # a model run in fp64: the angles in fp32 (`Rope.at`), the rotation in fp64
        cis = cis.to(torch.complex128)
    tail = x[..., width - d :]
    pairs = torch.view_as_complex(widen(tail).view(*tail.shape[:-1], d // 2, 2).contiguous())
    rotated = torch.view_as_real(pairs * cis).view(tail.shape)
    out = x.clone()
    out[..., width - d :] = as_dtype(rotated, x.dtype)
    return out


def _untracked(x: torch.Tensor, other: torch.Tensor) -> bool:
    """No gradient to track through ``x`` and ``other`` (the kernels keep no autograd graph)."""
    return not (torch.is_grad_enabled() and (x.requires_grad or other.requires_grad))


def _checked_kernels(op: str) -> ModuleType | None:
    """The compiled kernels when ``op`` may run in them: built, not switched off, and `kernels_agree` for it."""
    kernels = native.fp4_kernels()
    return kernels if kernels is not None and kernels_agree(op) else None


def rope_kernels(rope_dim: int) -> ModuleType | None:
    """The compiled kernels when a rotation of ``rope_dim`` dims may run in them (``rope_rotate``, and the fused
    projections that rotate: ``project_rows``, ``project_out_rows``, ``index_query_rows``): built, not switched
    off, `kernels_agree` for ``"rope_rotate"``, and where ``rope_dim`` is not a multiple of 32 for that
    ``rope_dim`` too (there torch's complex product runs its scalar tail, whose bits depend on how torch's build
    compiled it: see ``formats/rope_kernels.cpp``); else None."""
    kernels = _checked_kernels("rope_rotate")
    if kernels is None or (rope_dim % 32 and not kernels_agree("rope_rotate", rope_dim)):
        return None
    return kernels


@functools.cache
def kernels_agree(op: str, rope_dim: int | None = None) -> bool:
    """Whether the compiled ``op`` (``"rms_norm"`` or ``"rope_rotate"``) gives the torch formula's bits on
    adversarial inputs on this machine, checked once per process (some 20 ms); a mismatch logs a warning.

    The inputs: rows 1, 3 and 16 (and 61 for the norm at `_PREFILL_WIDTHS`); every width 1..80 and either side of
    128, 256, 512, 1024 for the norm (every split of a vector loop and its tail), eps 1e-20 and 1e-6; rope_dim 32,
    64 and 128 for the rotation, inverse too, on ``[H, T, D]`` transposed views as attention passes them and on
    ``[T, D]``; values normal, ±0, ±inf, subnormal, near the fp32 limits (no NaN inputs: the kernels decline NaN
    outputs, which inf · 0 still makes). With ``rope_dim`` (the rotation only, an even rope_dim that is not a
    multiple of 32): that rope_dim on every row count 1..16 (torch's loop length, hence whether it reaches its
    scalar tail, is a multiple of rope_dim/2 set by the rows), with ``cis`` per row and broadcast over the heads.

    Raises:
        ValueError: an unknown ``op``, or a ``rope_dim`` that is odd, a multiple of 32 or given for the norm;
            RuntimeError: the kernels did not build.
    """
    if op not in ("rms_norm", "rope_rotate"):
        raise ValueError(f"unknown kernel {op!r}")
    if rope_dim is not None and (op != "rope_rotate" or rope_dim <= 0 or rope_dim % 2 or rope_dim % 32 == 0):
        raise ValueError(f"{op} is not checked at rope_dim {rope_dim}")
    kernels = native.fp4_kernels()
    if kernels is None:
        raise RuntimeError("kvdiet's compiled kernels are switched off or did not build")
    gen = torch.Generator(device="cpu").manual_seed(0)
    ran = 0
    with torch.inference_mode():
        for case, (got, want) in enumerate(_cases(op, kernels, gen, rope_dim)):
            if got is None:  # declined (a NaN output): the torch formula runs such inputs
                continue
            ran += 1
            if not _same_bits(got, want):
                if rope_dim is None:
                    _log.warning(
                        "compiled %s differs from torch's formula (case %d); using torch's", op, case
                    )
                else:  # expected on builds whose scalar tail contracts to FMA: not a fault
                    _log.info(
                        "rope_dim %d: torch's scalar tail rounds otherwise here; using torch's", rope_dim
                    )
                return False
    if ran == 0:
        log = _log.warning if rope_dim is None else _log.info  # a wide rope_dim whose checks all overflow
        log("compiled %s declined every check; using torch's", op)
    return ran > 0


def _cases(
    op: str, kernels: ModuleType, gen: torch.Generator, rope_dim: int | None = None
) -> Iterator[tuple[torch.Tensor | None, torch.Tensor]]:
    """(compiled result or None, torch formula's result) pairs of `kernels_agree`'s inputs."""
    if op == "rms_norm":
        for width in [*range(1, 81), 127, 128, 129, 255, 256, 257, 511, 512, 513, 1023, 1024, 1025]:
            for rows in (
                (1, 3, 16, 61) if width in _PREFILL_WIDTHS else (1, 3, 16)
            ):  # 61: a prefill's (any_rows)
                x = _adversarial(rows * width, gen, nan=False).view(rows, width)
                weight = _adversarial(width, gen, nan=False)
                for eps in (1e-20, 1e-6):
                    yield (
                        kernels.rms_norm(x, weight, eps, any_rows=rows > 16),
                        _torch_rms_norm(x, weight, eps),
                    )
        return
    if rope_dim is None:
        shapes = [
            (d, rows, heads, width)
            for d in (32, 64, 128)
            for rows, heads, width in ((1, 1, d), (3, 4, d + 64), (16, 4, 512))
        ]
    else:
        shapes = [(rope_dim, rows, 4, rope_dim + 64) for rows in range(1, 17)]
    for d, rows, heads, width in shapes:
        x = _adversarial(rows * heads * width, gen, nan=False).view(rows, heads, width)
        angles = torch.rand(rows, d // 2, generator=gen, dtype=_F32, device="cpu") * 1e4
        cis = torch.polar(torch.ones_like(angles), angles)
        cis[0] = torch.view_as_complex(_adversarial(d, gen, nan=False).view(d // 2, 2))
        for c in (cis, cis.conj().resolve_conj()):
            for v in (x.transpose(0, 1), x[:, 0]):
                yield kernels.rope_rotate(v, c, d), _torch_rotate(v, c, d)
            if rope_dim is not None:  # cis [T, 1, d/2] against x [T, H, D]: torch's loop runs d/2 at a time
                yield kernels.rope_rotate(x, c[:, None], d), _torch_rotate(x, c[:, None], d)


# Widths `kernels_agree` also checks at a prefill's row count (the vector and tail splits are every width's at 1..16
# rows; what more rows add is torch's sum over them).
_PREFILL_WIDTHS = (1, 17, 64, 79, 257, 1025)
_SPECIALS = (0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -3e-39, 1e-38, 3.4e38, -3.4e38, 1e19, 1e-19)


def _adversarial(n: int, gen: torch.Generator, *, nan: bool = True) -> torch.Tensor:
    """fp32 [n] on the CPU (whatever torch's defaults): normal values at scales 1e-20..1e19, every tenth (on
    average) one of `_SPECIALS`."""
    scales = 10.0 ** torch.randint(-20, 20, (n,), generator=gen, device="cpu").to(_F32)
    x = torch.randn(n, generator=gen, dtype=_F32, device="cpu") * scales
    specials = torch.tensor([v for v in _SPECIALS if nan or not math.isnan(v)], dtype=_F32, device="cpu")
    chosen = torch.rand(n, generator=gen, dtype=_F32, device="cpu") < 0.1
    x[chosen] = specials[torch.randint(len(specials), (int(chosen.sum()),), generator=gen, device="cpu")]
    return x


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, strides, dtype and bits (NaN payloads included)."""
    return (
        a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and torch.equal(a.view(torch.int32), b.view(torch.int32))
    )
