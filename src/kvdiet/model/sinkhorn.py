"""The Sinkhorn normalisation of mHC's comb matrices (v41-spec §8.1a), in place: one compiled call per
sublayer on the CPU instead of some 120 tiny torch ops, bit-identical to the pure-torch path.

`sinkhorn_` runs ``sinkhorn.c`` (plain C, called through ``ctypes``) on contiguous fp32/fp64 CPU tensors
with hc ≤ 4, and the pure-torch loop everywhere else (a GPU, autograd, wider matrices). The C file is
compiled once per machine at first use with the system C compiler (``$CC`` or ``cc``; well under a second)
into ``kvdiet/`` under torch's extension cache (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``), named by a digest of the source and flags, written to a private file and
renamed into place so concurrent builds never see each other's half-written library.
``KVDIET_NATIVE_KERNELS=0`` selects the pure-torch path (read on every call, so tests can run both); a
failed build logs a warning once and uses it too. Why hc ≤ 4: torch's CPU sum over a dim of at most 4 values
adds them one at a time from 0, the order the C loops repeat; wider sums split into partial sums.
`softmax_sinkhorn` adds the softmax before it (comb from its logits) to the same call, where torch runs
AVX2/AVX512 kernels on x86-64: it repeats torch's softmax for short rows with the vector exp torch itself
calls (found in torch's library and checked against ``torch.softmax`` once per process).
This module knows nothing of where the matrices come from (`kvdiet.model.hc`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

from kvdiet.formats.native import ENV, build_root, cpu_isa

__all__ = ["MAX_MIX_ROWS", "hc_mix", "hc_mix_address", "sinkhorn_", "sinkhorn_kernel", "softmax_sinkhorn"]

_SOURCE = Path(__file__).with_name("sinkhorn.c")
_FLAGS = ["-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]
_ISA_FLAGS = {"AVX512": ["-mavx512f"], "AVX2": ["-mavx2"]}  # wider vectors; the same IEEE adds and divides
_MAX_HC = 4  # widest matrix whose torch sums the C loops repeat (see the module docstring)
_log = logging.getLogger(__name__)


def sinkhorn_(comb: torch.Tensor, *, eps: float, iters: int) -> torch.Tensor:
    """Normalise softmax rows ``comb`` [..., hc, hc] in place and return it: ``comb += eps``; each column
    divided by (its sum + eps); then (iters − 1) × [each row divided by (its sum + eps); each column
    likewise]. Same dtype, shape and values (bit for bit) on both paths.

    Args:
        comb: fp32 or fp64 [..., hc, hc] (row i, column j), modified in place.
        eps: config ``hc_eps``; iters: config ``hc_sinkhorn_iters`` (≥ 1).
    """
    hc = comb.shape[-1]
    lib = sinkhorn_kernel()
    if (
        lib is not None
        and comb.device.type == "cpu"
        and comb.dtype in (torch.float32, torch.float64)
        and hc <= _MAX_HC
        and comb.is_contiguous()
        and not comb.requires_grad
    ):
        if comb.numel():
            run = lib.kvdiet_sinkhorn_f32 if comb.dtype == torch.float32 else lib.kvdiet_sinkhorn_f64
            if run(comb.data_ptr(), comb.numel() // (hc * hc), hc, iters, eps):
                raise RuntimeError(f"the Sinkhorn kernel refused hc={hc}")
        return comb
    comb.add_(eps)
    comb.div_(comb.sum(-2, keepdim=True).add_(eps))
    for _ in range(iters - 1):
        comb.div_(comb.sum(-1, keepdim=True).add_(eps))
        comb.div_(comb.sum(-2, keepdim=True).add_(eps))
    return comb


def softmax_sinkhorn(logits: torch.Tensor, *, eps: float, iters: int) -> torch.Tensor:
    """The comb matrices from their logits (v41-spec §8.1a): ``sinkhorn_(torch.softmax(logits, dim=-1))`` as
    a new contiguous tensor, the same values bit for bit on both paths.

    The compiled path (``kvdiet_softmax_sinkhorn_f32``) takes fp32 CPU logits [n, hc, hc], hc ≤ 4, with
    contiguous matrices evenly spaced (a column slice of the mixes), when torch runs its AVX512 or AVX2
    kernels: it calls the vector exp torch's softmax calls (`_torch_vector_exp`), so it needs no softmax op
    and no thread-pool start (torch's softmax starts one per call when it has 2+ threads, even for 4 rows).

    Args:
        logits: [..., hc, hc], any float dtype and strides (not modified).
        eps: config ``hc_eps``; iters: config ``hc_sinkhorn_iters`` (≥ 1).
    Returns:
        comb [..., hc, hc] in the logits' dtype, contiguous.
    Raises:
        RuntimeError: the kernel refused arguments it was promised to take.
    """
    hc = logits.shape[-1]
    lib = sinkhorn_kernel()
    if (
        lib is not None
        and logits.dim() == 3
        and logits.dtype == torch.float32
        and logits.device.type == "cpu"
        and hc <= _MAX_HC
        and logits.shape[-2] == hc
        and logits.stride(-1) == 1
        and logits.stride(-2) == hc
        and not logits.requires_grad
    ):
        vexp = _torch_vector_exp()
        if vexp is not None:
            comb = torch.empty(logits.shape, dtype=torch.float32, device="cpu")
            n = logits.shape[0]
            if n and lib.kvdiet_softmax_sinkhorn_f32(
                logits.data_ptr(), logits.stride(0), comb.data_ptr(), n, hc, iters, eps, *vexp
            ):
                raise RuntimeError(f"the softmax-Sinkhorn kernel refused hc={hc}")
            return comb
    return sinkhorn_(torch.softmax(logits.contiguous(), dim=-1), eps=eps, iters=iters)


def sinkhorn_kernel() -> ctypes.CDLL | None:
    """The compiled library (``kvdiet_sinkhorn_f32`` / ``_f64``), or None for the pure-torch path.

    None when ``KVDIET_NATIVE_KERNELS=0`` or when the build failed (logged once).
    """
    if os.environ.get(ENV, "1") == "0":
        return None
    return _load()


@functools.cache
def _load() -> ctypes.CDLL | None:
    isa = cpu_isa()
    flags = [*_FLAGS, *_ISA_FLAGS.get(isa, [])]
    digest = hashlib.sha256(
        b"\0".join([_SOURCE.read_bytes(), *map(str.encode, [*flags, platform.machine()])])
    )
    try:
        root = build_root()
        path = root / f"kvdiet_sinkhorn_{isa.lower()}_{digest.hexdigest()[:12]}.so"
        if not path.exists():
            compiler = os.environ.get("CC") or shutil.which("cc") or "gcc"
            root.mkdir(parents=True, exist_ok=True)
            private = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            subprocess.run(
                [compiler, *flags, str(_SOURCE), "-o", str(private), "-lm"], check=True, capture_output=True
            )
            os.replace(private, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as error:  # no compiler: the pure-torch path still works
        detail = (getattr(error, "stderr", b"") or b"")[:500].decode(errors="replace")
        _log.warning("Sinkhorn kernel did not build (%s %s); using the pure-torch path", error, detail)
        return None
    for name, real in (("kvdiet_sinkhorn_f32", ctypes.c_float), ("kvdiet_sinkhorn_f64", ctypes.c_double)):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, real]
        fn.restype = ctypes.c_int
    fn = lib.kvdiet_softmax_sinkhorn_f32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_float]
    fn.argtypes += [ctypes.c_void_p, ctypes.c_int64]
    fn.restype = ctypes.c_int
    fn = lib.kvdiet_sigmoid_f32
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64], ctypes.c_int
    fn = lib.kvdiet_hc_mix_f32
    fn.argtypes = [*[ctypes.c_void_p] * 4, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_float]
    fn.argtypes += [ctypes.c_int64, *[ctypes.c_void_p] * 4, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return lib


_TORCH_VECTOR_EXP = {"AVX512": ("Sleef_expf16_u10", 16), "AVX2": ("Sleef_expf8_u10", 8)}
"""torch's CPU capability -> the fp32 vector exp its kernels call (``Vectorized<float>::exp``) and its lanes."""


@functools.cache
def _torch_vector_exp() -> tuple[int, int] | None:
    """(address, lanes) of the vector exp torch's softmax calls, taken from torch's own ``libtorch_cpu``; None
    (the torch path then) for other capabilities or platforms, a library or symbol not found, or when the
    compiled softmax disagrees with ``torch.softmax`` by one bit on a fixed battery (logged once)."""
    name, lanes = _TORCH_VECTOR_EXP.get(torch.backends.cpu.get_cpu_capability(), ("", 0))
    lib = _load()
    if not name or lib is None or platform.machine() != "x86_64":
        return None
    try:
        torch_cpu = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        address = ctypes.cast(getattr(torch_cpu, name), ctypes.c_void_p).value
    except (OSError, AttributeError) as error:
        _log.warning("torch's vector exp not found (%s); the comb softmax stays torch's", error)
        return None
    g = torch.Generator().manual_seed(0)
    for hc in range(1, _MAX_HC + 1):
        draws = [
            torch.randn(128, hc, hc, generator=g, dtype=torch.float32) * s for s in (0.1, 1.0, 4.0, 30.0)
        ]
        logits = torch.cat(draws)
        got = torch.empty_like(logits)
        # iters 0 and eps 0: the softmax alone (the normalisation only adds 0 to positive entries)
        status = lib.kvdiet_softmax_sinkhorn_f32(
            logits.data_ptr(), hc * hc, got.data_ptr(), logits.shape[0], hc, 0, 0.0, address, lanes
        )
        if status or not torch.equal(got, torch.softmax(logits, dim=-1)):
            _log.warning(
                "the compiled softmax differs from torch %s's (%s); torch's is used", torch.__version__, name
            )
            return None
    for n in (*range(1, 4 * lanes + 1), 1000):  # every split between the vector and the scalar loop
        values = torch.randn(n, generator=g, dtype=torch.float32) * 6
        got = values.clone()
        if lib.kvdiet_sigmoid_f32(got.data_ptr(), n, address, lanes) or not torch.equal(
            got, torch.sigmoid(values)
        ):
            _log.warning(
                "the compiled sigmoid differs from torch %s's (%s); torch's is used", torch.__version__, name
            )
            return None
    return address, lanes


MAX_MIX_ROWS = 256
"""Most rows `hc_mix` takes: decode steps and small batches (torch's sigmoid stays on one thread far beyond)."""


@functools.cache
def hc_mix_address() -> tuple[int, int, int] | None:
    """``(address of kvdiet_hc_mix_f32, address of torch's vector exp, its lanes)``: what a compiled caller
    (``formats/hc_kernels.cpp``) needs to run `hc_mix`'s kernel itself, with the same bits; None where the
    kernel did not build or the vector exp was not found. Found once per process; it does not read
    ``KVDIET_NATIVE_KERNELS``: its caller does (`kvdiet.model.hc`, through `kvdiet.formats.native.fp4_kernels`)."""
    lib = _load()
    vexp = None if lib is None else _torch_vector_exp()
    if vexp is None:
        return None
    return ctypes.cast(lib.kvdiet_hc_mix_f32, ctypes.c_void_p).value, *vexp


def hc_mix(
    mixes: torch.Tensor,
    mean_sq: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    rms_eps: float,
    hc_eps: float,
    iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """mHC (pre, post, comb) from the mixes before their norm (v41-spec §8.1a) in one compiled call, the values
    of the formula's torch ops bit for bit (``kvdiet_hc_mix_f32``: the rsqrt, scale and base, both sigmoids
    as torch runs them, then `softmax_sinkhorn`); None where it does not apply: the kernel or torch's vector
    exp unavailable, ``KVDIET_NATIVE_KERNELS=0``, not fp32 CPU tensors, shapes that do not fit (below), more
    than `MAX_MIX_ROWS` rows, hc > 4, or a tensor that needs grad.

    Args:
        mixes: ``flatten(h) · fnᵀ`` fp32 [T, (2+hc)·hc], contiguous; overwritten (with the scaled logits).
        mean_sq: ``mean(flatten(h)²)`` fp32 [T]; scale: each mix's scale fp32 [(2+hc)·hc]; base: fp32
            [(2+hc)·hc] (contiguous).
        rms_eps: config ``rms_norm_eps``; hc_eps: config ``hc_eps``; iters: config ``hc_sinkhorn_iters``.
    Returns:
        (pre [T, hc], post [T, hc], comb [T, hc, hc]) fp32, or None.
    """
    lib = sinkhorn_kernel()
    t, n_mix = mixes.shape
    hc = round((n_mix + 1) ** 0.5) - 1  # n_mix = (2 + hc)·hc = (hc + 1)² − 1
    if (
        lib is None
        or t > MAX_MIX_ROWS
        or hc > _MAX_HC
        or n_mix != (2 + hc) * hc
        or tuple(mean_sq.shape) != (t,)
        or tuple(scale.shape) != (n_mix,)
        or tuple(base.shape) != (n_mix,)
        or not mixes.dtype == mean_sq.dtype == scale.dtype == base.dtype == torch.float32
        or not (mixes.is_cpu and mean_sq.is_cpu and scale.is_cpu and base.is_cpu)
        or mixes.requires_grad
        or not (
            mixes.is_contiguous()
            and mean_sq.is_contiguous()
            and scale.is_contiguous()
            and base.is_contiguous()
        )
    ):
        return None
    vexp = _torch_vector_exp()
    if vexp is None:
        return None
    f32 = torch.float32
    pre, post, comb = (
        torch.empty(t, hc, dtype=f32, device="cpu"),
        torch.empty(t, hc, dtype=f32, device="cpu"),
        torch.empty(t, hc, hc, dtype=f32, device="cpu"),
    )
    ptrs = (mixes.data_ptr(), mean_sq.data_ptr(), scale.data_ptr(), base.data_ptr())
    out = (pre.data_ptr(), post.data_ptr(), comb.data_ptr())
    if t and lib.kvdiet_hc_mix_f32(*ptrs, t, hc, rms_eps, hc_eps, iters, *out, *vexp):
        raise RuntimeError(f"the mHC kernel refused hc={hc}")
    return pre, post, comb
