"""The tree keeps the shape issue 14 gave it: nothing decides by a policy's or a source's name, the simulator
runs the control plane of `kvdiet.cache` (no rules of its own), and no module grows past ~400 lines."""

from __future__ import annotations

import re
from pathlib import Path

import kvdiet

ROOT = Path(kvdiet.__file__).parent
MAX_LINES = 400


def _sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(ROOT.rglob("*.py"))}


def test_nothing_decides_by_a_policy_or_source_name() -> None:
    pattern = re.compile(
        r'policy\.name ==|== "(bounded-replay|swa-pool|boundary-snapshot|full-store|exact-recompute)"'
    )
    hits = [
        f"{path}:{i + 1}"
        for path, text in _sources().items()
        for i, line in enumerate(text.splitlines())
        if pattern.search(line)
    ]
    assert hits == []


def test_the_simulator_runs_the_cache_control_plane() -> None:
    text = _sources()["sim/model_free.py"]
    assert "from kvdiet.cache.control import" in text and "ControlPlane(" in text
    # the rules live in cache/: no TTL arithmetic, LRU order or policy decisions in the simulator
    for rule in ("move_to_end", "deadline", "capture_at(", ".plan(hit", "checkpoints("):
        assert rule not in text, rule


def test_no_module_is_over_400_lines() -> None:
    long = {path: text.count("\n") for path, text in _sources().items() if text.count("\n") > MAX_LINES}
    assert long == {}
