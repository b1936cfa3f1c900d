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

__all__ = ["sinkhorn_", "sinkhorn_kernel"]

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
                [compiler, *flags, str(_SOURCE), "-o", str(private)], check=True, capture_output=True
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
    return lib
