"""The README's commands as a new user and CI run them (issue 18 points 2 and 9): the CPU-only set-up line
pins the same torch as ``pyproject.toml``; the test command installs what the tests need
(``tests/system-deps.sh``: redis-server and libibverbs1 through apt-get, sudo unless root) and ``.ci/run`` runs exactly
that command and installs nothing itself."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()
SYSTEM_DEPS = ROOT / "tests" / "system-deps.sh"


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def _test_command() -> str:
    """The line .ci/run reads: the second line after the marker (the first is the code fence)."""
    lines = README.splitlines()
    return lines[lines.index("<!-- ci:test-command -->") + 2]


def _torch_pin() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if d.startswith("torch==")]
    return pin


def test_the_set_up_section_has_a_copyable_cpu_only_command() -> None:
    setup = README.split("## Set up and run")[1].split("\n## ")[0]
    cpu = [
        line
        for block in _bash_blocks(setup)
        for line in block.splitlines()
        if "--index-url https://download.pytorch.org/whl/cpu" in line
    ]
    assert len(cpu) == 1, "one CPU-only set-up command"
    steps = [step.strip() for step in cpu[0].split("&&")]
    torch_step = f"pip install {_torch_pin()} --index-url https://download.pytorch.org/whl/cpu"
    assert steps.index(torch_step) < steps.index("pip install -e .")  # the CPU wheel first
    assert steps[0] == "python3 -m venv .venv" and steps[-1] == "kvdiet serve"


def test_the_test_command_installs_system_packages_first() -> None:
    cmd = _test_command()
    assert cmd.startswith("bash tests/system-deps.sh && python3 -m venv .venv && ")
    assert cmd.endswith('pip install -e ".[dev,mooncake]" && python -m pytest')
    assert os.access(SYSTEM_DEPS, os.R_OK)


def test_ci_runs_exactly_the_readme_command_and_installs_nothing_else() -> None:
    code = "\n".join(line for line in CI.splitlines() if not line.lstrip().startswith("#"))
    assert "awk '/<!-- ci:test-command -->/ {getline; getline; print; exit}' README.md" in code
    assert 'bash -euo pipefail -c "$test_cmd"' in code
    for forbidden in ("apt-get", "pip install", "redis-server", "sudo", "curl", "wget"):
        assert forbidden not in code, forbidden


def _fake_bin(tmp_path: Path, *, uid: int, tools: tuple[str, ...]) -> tuple[Path, Path]:
    """A PATH of stand-ins that log their calls: ``id -u`` prints ``uid``; apt-get and sudo log and succeed;
    ``ldconfig -p`` lists libibverbs.so.1 (``ldconfig``) or not (``ldconfig-empty``)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    scripts = {
        "id": f"#!/bin/sh\necho {uid}\n",
        "apt-get": f'#!/bin/sh\necho "apt-get $*" >> {log}\n',
        "sudo": f'#!/bin/sh\necho "sudo" >> {log}\nexec "$@"\n',
        "redis-server": "#!/bin/sh\nexit 0\n",
        "ldconfig": "#!/bin/sh\necho '\tlibibverbs.so.1 (libc6,x86-64) => /lib/libibverbs.so.1'\n",
        "ldconfig-empty": "#!/bin/sh\necho '0 libs found in cache'\n",
    }
    for name in tools:
        path = bin_dir / name.removesuffix("-empty")
        path.write_text(scripts[name])
        path.chmod(0o755)
    (bin_dir / "env").symlink_to(shutil.which("env"))
    return bin_dir, log


def _run_system_deps(bin_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["/bin/bash", str(SYSTEM_DEPS)],
        env={"PATH": str(bin_dir)},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(("uid", "sudo"), [(1000, ["sudo"]), (0, [])], ids=["user", "root"])
def test_system_deps_installs_what_is_missing(tmp_path: Path, uid: int, sudo: list[str]) -> None:
    bin_dir, log = _fake_bin(tmp_path, uid=uid, tools=("id", "apt-get", "sudo", "ldconfig-empty"))
    proc = _run_system_deps(bin_dir)
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().splitlines() == [
        *sudo,
        "apt-get update",
        *sudo,
        "apt-get install -y --no-install-recommends redis-server libibverbs1",
    ]


def test_system_deps_installs_only_libibverbs_when_redis_is_there(tmp_path: Path) -> None:
    bin_dir, log = _fake_bin(tmp_path, uid=0, tools=("id", "apt-get", "redis-server", "ldconfig-empty"))
    proc = _run_system_deps(bin_dir)
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().splitlines()[-1] == "apt-get install -y --no-install-recommends libibverbs1"


def test_system_deps_does_nothing_when_all_is_there(tmp_path: Path) -> None:
    bin_dir, log = _fake_bin(tmp_path, uid=1000, tools=("id", "apt-get", "sudo", "redis-server", "ldconfig"))
    proc = _run_system_deps(bin_dir)
    assert proc.returncode == 0 and not log.exists() and proc.stderr == ""


def test_system_deps_without_apt_get_names_the_package(tmp_path: Path) -> None:
    bin_dir, _ = _fake_bin(tmp_path, uid=1000, tools=("id", "ldconfig-empty"))
    proc = _run_system_deps(bin_dir)
    assert proc.returncode == 1
    assert "the tests need redis-server libibverbs1; install it with your package manager" in proc.stderr


def _readme_tree(root: str) -> set[str]:
    """The files the README's layout tree lists under ``root`` (``src/kvdiet/``), as paths below it: two
    spaces of indent per level, a folder ends in ``/``, the first word of a line is the name."""
    lines = README.splitlines()
    listed, folders = set(), []
    for line in lines[lines.index(root) + 1 :]:
        if not line.startswith("  ") or not line.strip():
            break
        depth, name = (len(line) - len(line.lstrip(" "))) // 2 - 1, line.split()[0]
        folders = folders[:depth]
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
        else:
            listed.add("/".join([*folders, name]))
    return listed


def test_the_layout_tree_lists_every_source_file_once() -> None:
    """One line per file under ``src/kvdiet`` (issue 14): a file added, moved or removed updates the tree."""
    files = {
        p.relative_to(ROOT / "src" / "kvdiet").as_posix() for p in (ROOT / "src" / "kvdiet").rglob("*.py")
    }
    listed = _readme_tree("src/kvdiet/")
    assert "model/paged_pool.py" in listed and "storage/persistent_index.py" in listed
    assert sorted(files - listed) == [] and sorted(listed - files) == []


def test_the_layout_tree_lists_every_test_file_once() -> None:
    """One line per file under ``tests/`` (modules, helpers, scripts): a test file added or removed updates it."""
    tests = ROOT / "tests"
    files = {
        p.relative_to(tests).as_posix()
        for p in tests.rglob("*")
        if p.is_file()
        and not any(part == "__pycache__" or part.startswith(".") for part in p.relative_to(tests).parts)
    }
    listed = _readme_tree("tests/")
    assert "conftest.py" in listed and "system-deps.sh" in listed
    assert sorted(files - listed) == [] and sorted(listed - files) == []
