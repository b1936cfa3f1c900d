"""Shared fixtures: paths of the shipped configs, the two kernel paths (compiled and pure torch)."""

from __future__ import annotations

import json
import os

# The tests run on the Python sources of the simulator core unless KVDIET_SIMCORE=1 is set (then on the
# compiled one: `tests/test_sim_simcore.py` runs the simulator tests so, on a build of its own). Set
# before kvdiet is imported (``import kvdiet`` reads it).
os.environ.setdefault("KVDIET_SIMCORE", "0")

from pathlib import Path

import pytest

from kvdiet.config import config_dir


@pytest.fixture
def v41_path() -> Path:
    return config_dir() / "deepseek-v4.1-flash.json"


@pytest.fixture
def v41_json(v41_path: Path) -> dict:
    return json.loads(v41_path.read_text())


@pytest.fixture
def write_config(tmp_path: Path):
    """Write a config dict to a temporary file and return its path."""

    def write(data: dict, name: str = "config.json") -> Path:
        path = tmp_path / name
        path.write_text(json.dumps(data))
        return path

    return write


@pytest.fixture(scope="module", params=["native", "torch"])
def format_backend(request):
    """Run a module's tests on both FP4 codec paths: the compiled kernels (which must build here) and pure
    torch (``KVDIET_NATIVE_KERNELS=0``)."""
    from kvdiet.formats import native

    with pytest.MonkeyPatch.context() as mp:
        if request.param == "torch":
            mp.setenv(native.ENV, "0")
        else:
            mp.delenv(native.ENV, raising=False)
            assert native.fp4_kernels() is not None, "the FP4 kernels did not build"
        yield request.param


@pytest.fixture(scope="session")
def both():
    """``both(fn, *args, **kwargs)``: (result with the compiled kernels, which must build here; result on the
    pure-torch path, ``KVDIET_NATIVE_KERNELS=0``). Session-scoped (it restores the variable itself), so
    hypothesis tests may use it."""
    from kvdiet.formats import native

    assert native.fp4_kernels() is not None, "the FP4 kernels did not build"

    def run(fn, *args, **kwargs):
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv(native.ENV, raising=False)
            compiled = fn(*args, **kwargs)
            mp.setenv(native.ENV, "0")
            pure = fn(*args, **kwargs)
        return compiled, pure

    return run


@pytest.fixture(
    params=[
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                not __import__("torch").cuda.is_available(), reason="CUDA case: runs on a GPU machine"
            ),
        ),
    ]
)
def device(request) -> str:
    """The devices a model test runs on: ``cpu`` always, ``cuda`` where torch sees a GPU
    (`benchmarks/gpu_check.sh` runs these tests there)."""
    return request.param
