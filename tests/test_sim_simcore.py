"""The compiled simulator core (`kvdiet.sim.simcore`).

Built here from the current sources into a folder of this module's own, it must give every figure the Python
modules give: the simulator and control-plane tests run again, in a process of their own, on the compiled
modules (``test_sim_recorded.py`` holds every number of the default study and five sweeps to one digest).
`kvdiet replay` builds the core on first use and re-executes itself on it, printing the same JSON as on the
Python modules. Without a build: the key follows the sources, and a process that imported the modules
already keeps them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiet.sim import simcore

ROOT = Path(__file__).resolve().parents[1]
TESTS_ON_THE_CORE = (
    "tests/test_sim_recorded.py",
    "tests/test_sim_model_free.py",
    "tests/test_sim_study.py",
    "tests/test_sim_device_tree.py",
    "tests/test_sim_agentic.py",
    "tests/test_cache_control.py",
    "tests/test_cache_manager.py",
    "tests/test_cache_ttl_lru.py",
)


def _env(core_dir: Path, simcore_env: str | None) -> dict[str, str]:
    env = {**os.environ, "KVDIET_SIMCORE_DIR": str(core_dir)}
    env.pop("KVDIET_SIMCORE", None)
    if simcore_env is not None:
        env["KVDIET_SIMCORE"] = simcore_env
    return env


@pytest.fixture(scope="module")
def core_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("simcore")


def _trace(tmp_path: Path) -> Path:
    """A Mooncake-format trace: 300 requests of 40 sessions resending prompts that grow by 1–3 blocks of 512
    tokens a turn."""
    lines, ids, t = [], {}, 0
    for i in range(300):
        s = i % 40
        chain = ids.setdefault(s, [s * 1000])
        chain += [s * 1000 + len(chain) + k for k in range(1 + i % 3)]  # 1-3 new blocks per turn
        t += 700 + (i * 37) % 900
        lines.append(
            json.dumps(
                {
                    "timestamp": t,
                    "input_length": 512 * len(ids[s]) + 100,
                    "output_length": 50,
                    "hash_ids": ids[s],
                }
            )
        )
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
def test_replay_builds_the_core_on_first_use_and_prints_the_same_figures(
    core_dir: Path, tmp_path: Path
) -> None:
    trace = _trace(tmp_path)
    cmd = [sys.executable, "-m", "kvdiet.cli", "replay", str(trace), "--json", "--jobs", "2"]
    compiled = subprocess.run(cmd, env=_env(core_dir, None), capture_output=True, text=True, timeout=600)
    assert compiled.returncode == 0, compiled.stderr
    assert "compiling the simulator core with mypyc" in compiled.stderr
    assert (core_dir / simcore._key() / "ok").is_file()
    python = subprocess.run(cmd, env=_env(core_dir, "0"), capture_output=True, text=True, timeout=600)
    assert python.returncode == 0, python.stderr
    assert "compiling" not in python.stderr
    got, want = json.loads(compiled.stdout), json.loads(python.stdout)
    assert (got.pop("simulator_core"), want.pop("simulator_core")) == ("mypyc", "python")
    assert got == want
    # the `kvdiet` script, run where a file shadows a module the simulator imports: the re-executed process
    # does not put the working directory on sys.path either (python -P)
    (tmp_path / "bisect.py").write_text("raise ImportError('the working directory was put on sys.path')\n")
    script = [str(Path(sys.executable).with_name("kvdiet")), *cmd[3:]]
    shadowed = subprocess.run(script, cwd=tmp_path, env=_env(core_dir, None), capture_output=True, text=True)
    assert shadowed.returncode == 0, shadowed.stderr
    assert json.loads(shadowed.stdout)["simulator_core"] == "mypyc"
    off = subprocess.run([*cmd, "--simcore", "off"], env=_env(core_dir, None), capture_output=True, text=True)
    assert off.returncode == 0 and json.loads(off.stdout)["simulator_core"] == "python"
    # a program calling `main` is not the command's own process: it is never re-executed
    embed = f"from kvdiet.cli import main; print('once'); main({cmd[3:]!r})"
    called = subprocess.run(
        [sys.executable, "-c", embed], env=_env(core_dir, None), capture_output=True, text=True
    )
    assert called.returncode == 0 and called.stdout.count("once") == 1
    assert json.loads(called.stdout.split("\n", 1)[1])["simulator_core"] == "python"


@pytest.mark.slow
def test_the_simulator_tests_pass_on_the_compiled_modules(core_dir: Path) -> None:
    env = _env(core_dir, None)
    subprocess.run(
        [sys.executable, "-c", "from kvdiet.sim import simcore; simcore.build()"],
        env=env,
        check=True,
        timeout=600,
    )
    env["KVDIET_SIMCORE"] = "1"
    names = ", ".join(simcore.MODULES)
    show = f"import json, {names}; print(json.dumps([m.__file__ for m in [{names}]]))"
    where = subprocess.run([sys.executable, "-c", show], env=env, capture_output=True, text=True, check=True)
    files = json.loads(where.stdout)
    assert all(f.endswith(".so") and f.startswith(str(core_dir)) for f in files), files
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", *TESTS_ON_THE_CORE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0, run.stdout[-3000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert re.search(r"\b\d{3,} passed\b", summary) and "skipped" not in summary, summary


def test_the_build_key_follows_the_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    copies = []
    for path in simcore._sources():
        copy = tmp_path / path.name
        copy.write_bytes(path.read_bytes())
        copies.append(copy)
    monkeypatch.setattr(simcore, "_sources", lambda: copies)
    before = simcore._key()
    assert simcore._key() == before
    copies[3].write_text(copies[3].read_text() + "\n# an edit\n")
    assert simcore._key() != before


def test_a_process_that_imported_the_modules_keeps_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvdiet.sim.model_free  # noqa: F401 - imported: the Python module is what this process holds

    monkeypatch.setenv("KVDIET_SIMCORE_DIR", str(tmp_path))
    monkeypatch.delenv("KVDIET_SIMCORE", raising=False)
    (simcore.build_dir() / "ok").parent.mkdir(parents=True)
    (simcore.build_dir() / "ok").write_text("")  # a finished build, as far as activation can tell
    finders = list(sys.meta_path)
    assert simcore.activate() is False
    assert sys.meta_path == finders and not simcore.active()
    monkeypatch.setenv("KVDIET_SIMCORE", "0")
    assert simcore.activate() is False


def test_relaunch_does_nothing_when_turned_off_or_not_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVDIET_SIMCORE_DIR", str(tmp_path))
    monkeypatch.setattr(os, "execv", lambda *a: pytest.fail("re-executed"))
    lines: list[str] = []
    monkeypatch.setenv("KVDIET_SIMCORE", "0")
    simcore.relaunch(
        ["-c", "pass"], build_first=True, log=lines.append
    )  # turned off: returns, builds nothing
    monkeypatch.delenv("KVDIET_SIMCORE")
    simcore.relaunch(
        ["-c", "pass"], build_first=False, log=lines.append
    )  # not built, not asked to build: returns
    assert lines == [] and not any(tmp_path.iterdir())


def test_a_failed_build_is_logged_once_and_not_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVDIET_SIMCORE_DIR", str(tmp_path))
    monkeypatch.delenv("KVDIET_SIMCORE", raising=False)
    monkeypatch.setattr(os, "execv", lambda *a: pytest.fail("re-executed"))
    tries: list[int] = []

    def fail(log: object = None) -> Path:
        tries.append(1)
        raise simcore.SimcoreError(
            "mypyc build failed (exit 1): error: command 'cc' failed", "...\ncc: not found"
        )

    monkeypatch.setattr(simcore, "build", fail)
    monkeypatch.setattr(simcore, "_compiler", lambda: "/usr/bin/cc")
    failed = simcore.build_dir().with_suffix(".failed")
    lines: list[str] = []
    simcore.relaunch(["-c", "pass"], build_first=True, log=lines.append)
    assert tries == [1] and os.environ["KVDIET_SIMCORE"] == "0"
    assert lines == [
        "running the Python modules: the compiled simulator core is not available: mypyc build failed (exit 1): "
        f"error: command 'cc' failed (details: {failed})"
    ]
    assert (
        failed.read_text().splitlines()[0] == "compiler: /usr/bin/cc"
        and "cc: not found" in failed.read_text()
    )
    monkeypatch.delenv("KVDIET_SIMCORE")
    simcore.relaunch(["-c", "pass"], build_first=True, log=lines.append)  # the same sources: not tried again
    assert tries == [1] and "failed to build" in lines[1] and "delete it to retry" in lines[1]
    monkeypatch.setattr(simcore, "_compiler", lambda: "/opt/gcc/bin/cc")  # another compiler: tried again
    simcore.relaunch(["-c", "pass"], build_first=True, log=lines.append)
    assert tries == [1, 1]
