"""The import graph of ``src/kvdiet`` has no cycle, and its layers import only down DESIGN.md §3's list where
this file checks them (issue 14).

Every import counts, module-level or inside a function: a lazy import that only hides a cycle is still a
cycle. Imports under ``if TYPE_CHECKING:`` are annotations only and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvdiet

ROOT = Path(kvdiet.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _targets(name: str, path: Path) -> set[str]:
    """Every dotted name ``name`` imports, kvdiet or not (``from pkg import x`` gives ``pkg`` and ``pkg.x``)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for branch in ast.walk(tree)
        if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
        for stmt in branch.body
        for node in ast.walk(stmt)
    }
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                kept = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(kept + ([node.module] if node.module else []))
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
    return targets


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The kvdiet modules ``name`` imports (``from pkg import mod`` names the module, else the package)."""
    found = set()
    for target in _targets(name, path):
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def _reached(name: str, graph: dict[str, set[str]]) -> set[str]:
    """The kvdiet modules ``name`` may run: what it imports (lazy imports too), their packages' ``__init__``,
    and so on; but not the root package ``kvdiet``, whose imports are `kvdiet.threads` (at import it loads only
    the standard library; torch only in `set_threads`, which the root does not call) and the public names on
    first use (``kvdiet.LLM``), which no module does."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        for module in graph[todo.pop()]:
            parts = module.split(".")
            for new in (".".join(parts[:i]) for i in range(2, len(parts) + 1)):
                if new in graph and new not in seen:
                    seen.add(new)
                    todo.append(new)
    return seen - {name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_cycle() -> None:
    _, graph = _graph()
    assert len(graph) > 50 and graph["kvdiet.cli"]  # the walk saw the package
    assert _cycles(graph) == []


def _graph() -> tuple[dict[str, Path], dict[str, set[str]]]:
    modules = _modules()
    return modules, {name: _imports(name, path, modules) for name, path in modules.items()}


def test_the_model_imports_no_layer_above_it() -> None:
    """The model computes; blocks are reserved by the cache layer before the forward, tiers and serving are
    above it (DESIGN.md §3, issue 14). Checked on everything an import of a model module runs."""
    _, graph = _graph()
    above = ("cache", "storage", "engine", "server", "planner", "sim", "fidelity", "cli")
    for name in graph:
        if name.startswith("kvdiet.model."):
            bad = {m for m in _reached(name, graph) if m.split(".")[1:2] and m.split(".")[1] in above}
            assert not bad, f"{name} reaches {sorted(bad)}"


def test_the_cache_layer_the_storage_tiers_and_the_planner_import_no_torch() -> None:
    """``cache``, ``storage`` and ``planner`` are pure data, bytes and sums (DESIGN.md §3): no module of theirs,
    nor any kvdiet module they reach, imports torch, at module level or inside a function."""
    modules, graph = _graph()
    checked = [n for n in graph if n.split(".")[1:2] in (["cache"], ["storage"], ["planner"])]
    assert {"kvdiet.cache.block_pool", "kvdiet.storage.persistent", "kvdiet.planner.report"} <= set(checked)
    for name in checked:
        for module in {name} | _reached(name, graph):
            torch = {t for t in _targets(module, modules[module]) if t.split(".")[0] == "torch"}
            assert not torch, f"{name} reaches {module}, which imports {sorted(torch)}"


def test_the_model_imports_nothing_that_drives_it() -> None:
    """`load_model` lives in the model package; the engine, the server, the simulator and the commands import
    the model, never the other way round (issue 14)."""
    above = {"engine", "server", "sim", "fidelity", "cli"}
    modules = _modules()
    for name, path in modules.items():
        if name.startswith("kvdiet.model."):
            bad = {m for m in _imports(name, path, modules) if m.split(".")[1] in above}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_the_cycle_finder_finds_a_lazy_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_reached_includes_packages_and_lazy_imports() -> None:
    graph = {"k": {"k.d"}, "k.a": {"k.p.b"}, "k.p": {"k.c"}, "k.p.b": set(), "k.c": set(), "k.d": set()}
    assert _reached("k.a", graph) == {"k.p", "k.p.b", "k.c"}
