"""The compiled simulator core: the modules a model-free replay spends its time in, compiled to C by mypyc
and imported in place of their Python sources by a process that asks for them.

A model-free run spends ~90 µs and ~220 Python calls per request in a few pure-Python modules (`MODULES`:
the control plane, its keys, sizes and restore plans, the TTL/LRU tier rules, the size tiers, the device
tree, the per-group figures, the compute cost model and the replay loop). mypyc (mypy's compiler,
github.com/python/mypy/tree/master/mypyc) compiles those same sources, type-checked, into one C extension: no
second copy of any rule, the same figures to the last digit (``tests/test_sim_simcore.py``), about 1.8× less
CPU per run.

- `build` compiles `MODULES` into ``<cache>/<key>/`` (the cache: ``$KVDIET_SIMCORE_DIR``, else
  ``$XDG_CACHE_HOME/kvdiet/simcore``, else ``~/.cache/kvdiet/simcore``), about 15 s on 2 cores (other
  modules are not type-checked), once per version of the sources: ``key`` hashes the modules' sources,
  mypy's version and the Python build, so an edited module is never served from an older build. Concurrent
  builds of one key wait for each other.
- `activate` puts an import hook first on ``sys.meta_path`` that serves `MODULES` from that build. It must
  run before any of them is imported: a process cannot mix two copies of one class. ``KVDIET_SIMCORE=1``
  in the environment makes ``import kvdiet`` call it; ``0`` turns the core off everywhere.
- `relaunch` is how ``kvdiet replay`` gets there: it builds (when asked) and re-executes the command as
  ``python -P -m kvdiet.cli ARGS`` with ``KVDIET_SIMCORE=1``; the study's forked workers inherit the compiled
  modules. The environment variable, read at import, wins over ``--simcore``.

Without mypy or a C compiler, or after a failed build (logged), everything runs on the Python sources.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["ENV", "MODULES", "SimcoreError", "activate", "active", "build", "build_dir", "built", "relaunch"]

ENV = "KVDIET_SIMCORE"
"""Environment variable: ``1`` makes ``import kvdiet`` load the compiled core, ``0`` turns it off."""
MODULES = (
    "kvdiet.cache.counters",
    "kvdiet.cache.keys",
    "kvdiet.cache.geometry",
    "kvdiet.cache.plan",
    "kvdiet.cache.tier",
    "kvdiet.cache.ttl_lru",
    "kvdiet.cache.control",
    "kvdiet.sim.size_tier",
    "kvdiet.sim.device_tree",
    "kvdiet.sim.breakdown",
    "kvdiet.sim.cost",
    "kvdiet.sim.model_free",
)
"""The compiled modules, dependencies first."""
GROUP = "kvdiet_simcore"
"""mypyc's name for the shared library that holds the compiled code (``GROUP__mypyc``)."""
_PACKAGE = Path(__file__).resolve().parents[1]  # src/kvdiet
_MYPY_FLAGS = ("--follow-imports=skip", "--ignore-missing-imports")
"""Other modules are not type-checked (their values are plain Python objects to the compiled code)."""


class SimcoreError(RuntimeError):
    """The compiled core could not be built (no mypy, no C compiler, a type error): the message in one line,
    ``details`` the build's last lines of output."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


def _sources() -> list[Path]:
    return [_PACKAGE.parent.joinpath(*m.split(".")).with_suffix(".py") for m in MODULES]


def _key() -> str:
    """A hash of everything a build depends on: the modules' sources, this file (the build's flags), mypy's
    version, the Python build."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        mypy = version("mypy")
    except PackageNotFoundError:
        mypy = "none"
    h = hashlib.sha256(f"{mypy}|{sys.version}|{platform.machine()}|{sys.abiflags}".encode())
    for path in [Path(__file__), *_sources()]:  # this file too: the build's flags and steps
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    """The folder holding builds (see the module docstring)."""
    explicit = os.environ.get("KVDIET_SIMCORE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvdiet" / "simcore"


def build_dir() -> Path:
    """Where the build of the current sources lives (whether or not it exists yet)."""
    return cache_root() / _key()


def built() -> bool:
    """Whether the current sources have a finished build this process can read."""
    try:
        return (build_dir() / "ok").is_file() and os.access(build_dir(), os.R_OK | os.X_OK)
    except OSError:  # an unreadable cache (another user's): as if there were none
        return False


def _compiler() -> str:
    """The C compiler a build would use (its resolved path), or ``none``."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) or "none"


def _files(root: Path) -> dict[str, Path]:
    """Module name → compiled file of a finished build."""
    out = {}
    for path in root.rglob("*.so"):
        parts = path.relative_to(root).parts
        out[".".join([*parts[:-1], path.name.split(".")[0]])] = path
    return out


def build(log: Callable[[str], None] | None = None) -> Path:
    """Compile `MODULES` for the current sources unless already built; returns the build's folder.

    Runs ``setup.py build_ext`` with mypyc's ``mypycify`` in a child process, on a copy of the package's
    sources, then moves the extensions into place (a build is complete once its ``ok`` file exists).

    Raises:
        SimcoreError: mypy is not installed, or the type check or the C compile failed (the message ends
            with the build's last lines of output).
    """
    target = build_dir()
    if (target / "ok").is_file():
        return target
    if importlib.util.find_spec("mypyc") is None:
        raise SimcoreError("mypy (which holds mypyc) is not installed: pip install mypy")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building the same key: wait for it
        if (target / "ok").is_file():
            return target
        if log is not None:
            log(f"compiling the simulator core with mypyc into {target} (once per source version, ~15 s)")
        for leftover in target.parent.glob(f"{target.name}-*"):  # of a build of this key that was killed
            shutil.rmtree(leftover, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix=f"{target.name}-build-", dir=target.parent) as tmp:
            work = Path(tmp)
            shutil.copytree(
                _PACKAGE,
                work / "kvdiet",
                ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c", "*.cpp"),
            )
            paths = [str(p.relative_to(_PACKAGE.parent)) for p in _sources()]
            (work / "setup.py").write_text(
                "from setuptools import setup\n"
                "from mypyc.build import mypycify\n"
                f"setup(name={GROUP!r}, ext_modules=mypycify({[*_MYPY_FLAGS, *paths]!r}, group_name={GROUP!r},"
                " opt_level='3'))\n"
            )
            env = {**os.environ, "MYPY_CACHE_DIR": str(work / ".mypy_cache")}
            run = subprocess.run(
                [sys.executable, "setup.py", "build_ext", "--inplace"],
                cwd=work,
                env=env,
                capture_output=True,
                text=True,
            )
            if run.returncode != 0:
                lines = (run.stdout + run.stderr).strip().splitlines() or ["(no output)"]
                tail = "\n".join(lines[-40:])
                raise SimcoreError(f"mypyc build failed (exit {run.returncode}): {lines[-1][:200]}", tail)
            stage = Path(tempfile.mkdtemp(prefix=f"{target.name}-stage-", dir=target.parent))
            try:
                _stage(work, stage)
                (stage / "ok").write_text("\n".join(MODULES) + "\n")
                os.chmod(stage, 0o777 & ~_umask())  # mkdtemp's 0700 would hide a shared cache from others
                shutil.rmtree(target, ignore_errors=True)  # an unfinished earlier attempt
                os.rename(stage, target)
            finally:
                shutil.rmtree(stage, ignore_errors=True)  # left only when the rename did not happen
    return target


def _stage(work: Path, stage: Path) -> None:
    """Move the in-place extensions of a finished build from ``work`` into ``stage``.

    Raises:
        SimcoreError: a module or the shared library is missing.
    """
    for so in work.glob("**/*.so"):
        if so.relative_to(work).parts[0] == "build":  # setuptools' copies: the in-place ones are used
            continue
        dest = stage / so.relative_to(work)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(so), dest)
    names = set(_files(stage))
    missing = [m for m in MODULES if m not in names]
    if missing or f"{GROUP}__mypyc" not in names:
        raise SimcoreError(f"mypyc build made no extension for {', '.join(missing) or GROUP}")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class _Finder(importlib.abc.MetaPathFinder):
    """Serves the compiled modules (and their shared library) from one build."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def find_spec(self, name, path=None, target=None):
        file = self.files.get(name)
        if file is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(name, str(file))
        return importlib.util.spec_from_file_location(name, file, loader=loader)


def activate() -> bool:
    """Serve `MODULES` from the build of the current sources; False (nothing changed) when ``KVDIET_SIMCORE``
    is ``0``, there is no such build, or one of them is imported already (this process keeps the Python
    modules then)."""
    if os.environ.get(ENV) == "0" or active():
        return active()
    if not built() or any(m in sys.modules for m in MODULES):
        return False
    try:
        files = _files(build_dir())
    except OSError:
        return False
    sys.meta_path.insert(0, _Finder(files))
    return True


def active() -> bool:
    """Whether this process imports (or imported) the compiled modules."""
    return any(isinstance(f, _Finder) for f in sys.meta_path)


def relaunch(command: list[str], *, build_first: bool, log: Callable[[str], None]) -> None:
    """Re-execute ``python *command`` with the compiled core (``KVDIET_SIMCORE=1``); returns only
    when it does not: the core is active or turned off already, it is not built and ``build_first`` is
    False, or the build failed (one line logged; ``<key>.failed`` beside the builds keeps the compiler and the
    build's output, and later runs of the same sources with the same compiler use the Python modules without
    trying again: delete it to retry).

    For a program's own process only (`kvdiet.cli.entry`, a benchmark script): it replaces the running
    program, so ``command`` must run it again (``["-P", "-m", "kvdiet.cli", *args]``, ``[script, *args]``).
    """
    if os.environ.get(ENV) is not None or active():
        return
    if not built():
        failed = build_dir().with_suffix(".failed")
        compiler = f"compiler: {_compiler()}"
        if not build_first:
            return
        if _first_line(failed) == compiler:  # failed before with this compiler: not again
            log(
                f"running the Python modules: the simulator core failed to build ({failed}; delete it to retry)"
            )
            return
        try:
            build(log)
        except (SimcoreError, OSError) as exc:
            where = ""
            if isinstance(exc, SimcoreError):
                with contextlib.suppress(OSError):
                    failed.write_text(f"{compiler}\n{exc}\n{exc.details}\n")
                    where = f" (details: {failed})"
            log(f"running the Python modules: the compiled simulator core is not available: {exc}{where}")
            os.environ[ENV] = "0"
            return
    os.environ[ENV] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *command])


def _first_line(path: Path) -> str | None:
    try:
        with open(path) as f:
            return f.readline().rstrip("\n")
    except OSError:
        return None
