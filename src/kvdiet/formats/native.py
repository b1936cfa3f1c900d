"""Compiled block codecs: ``fp4_kernels.cpp``, ``gather_kernels.cpp``, ``index_kernels.cpp``, ``topk_kernels.cpp``,
``gemv_kernels.cpp``, ``expert_kernels.cpp``, ``router_kernels.cpp``, ``rmsnorm_kernels.cpp``, ``engram_kernels.cpp``,
``chain_kernels.cpp``, ``hc_kernels.cpp``, ``rope_kernels.cpp``, ``projection_kernels.cpp``, ``attend_kernels.cpp``,
``softmax_kernels.cpp``, ``layer_kernels.cpp``, ``reads_kernels.cpp`` then ``fp8_kernels.cpp`` (one module), built once
per machine at first use.

``fp4`` (and through it ``mxfp4``) and ``fp8`` (float32 window entries) encode and decode packed entries
with these kernels when they are available: one pass over each row instead of some twenty torch ops,
bit-identical to the pure-torch path (tests compare the two on every code, scale byte and rounding tie).
The kernels are JIT-built by
``torch.utils.cpp_extension`` into ``kvdiet/`` under its cache directory (``TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``; one build at a time under an flock, so a killed build never blocks
the next) with the C++ compiler torch uses (``c++``, gcc ≥ 9), vectorised for the CPU capability torch
detects (AVX512, AVX2 or baseline; part of the build's name, with torch's version and the places of the
headers, so machines or environments sharing a cache directory never load, or rebuild, each other's build), and
with OpenMP: the kernels split their rows over torch's intra-op threads
(``torch.set_num_threads``, kvdiet's ``--threads``; OpenMP resolves to the runtime torch loaded). The first
build takes about a minute; later processes load it in milliseconds.

``KVDIET_NATIVE_KERNELS=0`` selects the pure-torch path (read on every call, so tests can run both); a
failed build logs a warning once and uses the pure-torch path too. It knows nothing of entry layouts
beyond the two FP4 recipes (``RECIPE_E4M3X16``, ``RECIPE_UE8M0X32``) and the mxfp8 window entry. The same
build holds ``index_scores``, the indexer's scores on packed MXFP4 (or fp32) keys, called by
`kvdiet.model.index_scores`, ``select_topk`` / ``block_max``, the exact top-k and block maxima over those
scores, called by `kvdiet.model.selection`, and ``row_products``, the decode rows' ``x · Wᵀ`` in a fixed order,
called by `kvdiet.model.gemv`, ``expert_rows``, a decode step's SwiGLU experts in one call, called by
`kvdiet.model.moe`, ``rms_norm`` / ``rope_rotate``, RMSNorm and RoPE of decode rows with the torch formulas'
bits, called by `kvdiet.model.layers`, ``attend_rows``, a decode step's attention of one layer in one call in a
fixed order, called by `kvdiet.model.decode_attend`, ``read_fp8_window``, a decode step's window read, called by
`kvdiet.formats.fp8.read_window`, and ``gather_fp4``, a decode step's read of its selected FP4 entries through the
block tables, called by `kvdiet.formats.fp4.gather_main_kv`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

import torch

__all__ = [
    "ENV",
    "RECIPE_E4M3X16",
    "RECIPE_UE8M0X32",
    "build_root",
    "cpu_isa",
    "fp4_kernels",
    "kernel_output",
]

ENV = "KVDIET_NATIVE_KERNELS"
"""Environment variable: ``0`` selects the pure-torch format kernels."""
RECIPE_E4M3X16 = 0
"""Kernel recipe id: blocks of 16, E4M3 scales (``fp4_e2m1_e4m3x16``)."""
RECIPE_UE8M0X32 = 1
"""Kernel recipe id: blocks of 32, UE8M0 scales (``mxfp4``)."""

_SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "fp4_kernels.cpp",
        "gather_kernels.cpp",
        "index_kernels.cpp",
        "topk_kernels.cpp",
        "gemv_kernels.cpp",
        "expert_kernels.cpp",
        "router_kernels.cpp",
        "rmsnorm_kernels.cpp",
        "engram_kernels.cpp",
        "chain_kernels.cpp",
        "hc_kernels.cpp",
        "rope_kernels.cpp",
        "projection_kernels.cpp",
        "attend_kernels.cpp",
        "softmax_kernels.cpp",
        "layer_kernels.cpp",
        "reads_kernels.cpp",
        "fp8_kernels.cpp",
    )
]
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],  # F16C (vcvtph2ps): on every AVX2 CPU (Intel since Ivy Bridge)
}
_log = logging.getLogger(__name__)


def fp4_kernels() -> ModuleType | None:
    """The built kernels (``encode_fp4``, ``decode_fp4``, ``gather_fp4``, ``index_scores`` with
    ``index_integer_path`` and ``index_integer_groups`` (whether its integer path runs on this CPU, and how often it
    ran) and ``index_amx_path`` and ``index_amx_groups`` (the same for its AMX products), ``select_topk``,
    ``block_max``, ``row_products``, ``row_products_each``, ``expert_rows``, ``route_rows``,
    ``rms_norm``, ``engram_rows``, ``engram_hashes`` and ``engram_gate`` (`kvdiet.model.engram`), ``chain_bmm``
    (small batched products, called by `kvdiet.model.chain_products`), ``hc_enter``, ``hc_expand_rows``,
    ``rope_rotate``, ``project_rows``, ``project_out_rows``, ``index_query_rows``,
    ``attend_rows``, ``softmax_rows``, ``softmax_wide`` and ``softmax_wide_agrees`` (torch.softmax's bits over narrow
    and wide rows: `kvdiet.model.narrow_softmax`, and ``attend_rows`` itself), ``attn_head``, ``attn_tail`` and
    ``ffn_rows`` (a decode step's layer, through ``EntryWeights``,
    ``AttnWeights`` and ``FfnWeights``), ``encode_fp8``, ``decode_fp8``, ``read_fp8_window``, ``reads_hold`` and
    ``stamps_hold`` (a decode binding's checks, `kvdiet.model.module_reads`), and ``parallel_threads``: how many
    threads they run on), or None for the pure-torch path.

    None when ``KVDIET_NATIVE_KERNELS=0`` or when the build failed (logged once). The first call in a
    process without a cached build compiles it (about a minute on 2 cores).
    """
    # ``KVDIET_NATIVE_KERNELS=0`` at this moment, read inline (a decode step asks some 500 times; a helper's call
    # costs as much as the read): ``os.environ.get`` costs about 2 µs here (it encodes the key and decodes the
    # value each time), so CPython's mapping of the encoded bytes behind ``os.environ`` (which ``os.environ[...]
    # = ...``, ``del`` and pytest's monkeypatch update) is read directly, 0.1 µs, where it exists
    raw, encoded = getattr(os.environ, "_data", None), _ENCODED
    if raw is None or encoded is None:  # not CPython's os._Environ: the public read
        if os.environ.get(ENV, "1") == "0":
            return None
    elif raw.get(encoded[0]) == encoded[1]:
        return None
    return _build()


def kernel_output(
    out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A CPU tensor of ``shape`` and ``dtype`` for a kernel to write every element of: ``out`` where it is one,
    contiguous (a buffer its caller reuses), else a new one (``torch.empty``)."""
    if out is not None and out.shape == shape and out.dtype == dtype and out.is_cpu and out.is_contiguous():
        return out
    return torch.empty(shape, dtype=dtype, device="cpu")


def _encoded() -> tuple[object, object] | None:
    """(the key ``ENV``, the value ``"0"``) as ``os.environ`` stores them, or None where it has no encoders."""
    try:
        return os.environ.encodekey(ENV), os.environ.encodevalue("0")  # type: ignore[attr-defined]
    except AttributeError:
        return None


_ENCODED = _encoded()


def cpu_isa() -> str:
    """The vector extension torch found on this CPU: ``"AVX512"``, ``"AVX2"`` or ``"base"`` (it picks a
    kernel build's flags and is part of its name, so machines sharing a cache never load each other's)."""
    capability = torch.backends.cpu.get_cpu_capability()
    return next((name for name in ("AVX512", "AVX2") if capability.startswith(name)), "base")


def build_root() -> Path:
    """The folder of kvdiet's compiled kernels: ``kvdiet/`` under ``$TORCH_EXTENSIONS_DIR``, else under torch's
    default extension root (``~/.cache/torch_extensions/...``)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / "kvdiet"


@functools.cache
def _build() -> ModuleType | None:
    from torch.utils.cpp_extension import load_inline

    isa = cpu_isa()
    # no FMA contraction: exact IEEE steps; OpenMP: at::parallel_for is serial without it
    flags = ["-O3", "-ffp-contract=off", "-fopenmp", *_ISA_FLAGS.get(isa, [])]
    source = "\n".join(path.read_text() for path in _SOURCES)  # one translation unit
    # the headers' places too: torch writes them into the build's ninja file, so two environments (venvs) sharing
    # one cache folder under one name would rebuild each other's module on every load
    places = [str(Path(torch.__file__).parent), sysconfig.get_paths()["include"]]
    digest = hashlib.sha256("\0".join([source, *flags, torch.__version__, *places]).encode()).hexdigest()[:12]
    name = f"kvdiet_fp4_{isa.lower()}_{digest}"
    _log.info("loading FP4 kernels %s (built at first use: about a minute)", name)
    path = os.environ.get("PATH", "")
    try:
        import fcntl

        build = build_root() / name
        build.mkdir(parents=True, exist_ok=True)
        # torch's own build lock (a ``lock`` file) outlives a build that was killed, and every later process
        # would wait on it forever; an flock is released with its process: every kvdiet build holds it, so
        # a ``lock`` file found under it was left by a killed build
        with open(build.parent / f"{name}.flock", "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            if (build / "lock").exists():
                _log.warning("FP4 kernels: removing the lock a killed build left in %s", build)
                (build / "lock").unlink(missing_ok=True)
            # torch runs ``ninja`` from PATH: the one pip installed with kvdiet, also without an active venv
            os.environ["PATH"] = os.pathsep.join([_ninja_dir(), path])
            return load_inline(name, cpp_sources=source, extra_cflags=flags, build_directory=str(build))
    except Exception as error:  # no compiler, no headers: the pure-torch path still works
        _log.warning("FP4 kernels did not build (%s); using the pure-torch path", error)
        return None
    finally:
        os.environ["PATH"] = path


def _ninja_dir() -> str:
    """The folder of the ``ninja`` executable of the ``ninja`` package, or of this interpreter."""
    try:
        import ninja
    except ImportError:
        return str(Path(sys.executable).parent)
    return str(ninja.BIN_DIR)
