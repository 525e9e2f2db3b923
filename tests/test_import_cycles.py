"""No import cycles between selfdraft's modules, function-local imports included.

A cycle hidden by a function-local import still couples two modules both ways (each needs the other
to work) and breaks as soon as someone hoists the import. The graph is read with ``ast`` from the
source folders the distribution maps into ``selfdraft`` (pyproject's package-dir), so it sees every
import statement wherever it stands; only imports under ``if TYPE_CHECKING:`` are left out (they never
run). An import names the deepest selfdraft module it reaches: ``from selfdraft.train import checkpoint``
is ``selfdraft.train.checkpoint``, ``from selfdraft.inference.bench import run_bench`` the package
``selfdraft.inference.bench`` (its ``__init__.py``).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"selfdraft": "selfdraft", "selfdraft.heads": "heads", "selfdraft.train": "train",
            "selfdraft.inference": "inference", "selfdraft.configs": "configs"}
"""Import name -> source folder, as pyproject.toml's [tool.setuptools.package-dir] maps them."""


def module_files() -> dict[str, pathlib.Path]:
    """Every selfdraft module by its import name (a package by its ``__init__.py``)."""
    modules = {}
    for package, folder in PACKAGES.items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            if name.split(".")[:2] == ["selfdraft", "selfdraft"]:
                continue
            modules[name] = path
    return modules


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of import nodes inside ``if TYPE_CHECKING:`` blocks."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skipped


def imports_of(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The selfdraft modules that module ``name`` imports, anywhere in its body."""

    def deepest(dotted: str) -> str | None:
        parts = dotted.split(".")
        while parts:
            if ".".join(parts) in modules:
                return ".".join(parts)
            parts.pop()
        return None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = _type_checking_only(tree)
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" for a in node.names]  # a submodule, or a name in `base`
        else:
            continue
        for target in targets:
            if target.split(".")[0] != "selfdraft":
                continue
            module = deepest(target)
            if module is not None and module != name:
                found.add(module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in sorted(modules.items())}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) for every strongly connected group of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm; the graph is small, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_path_through(group, graph) for group in groups]


def _path_through(group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the group's first module, staying inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    following.append(w)
        frontier = following
    raise AssertionError(f"{sorted(group)} is not strongly connected")


def test_the_cycle_finder_finds_a_cycle_and_prints_it():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_function_local_and_relative_imports(tmp_path):
    modules = {"selfdraft.train.loop": tmp_path / "loop.py", "selfdraft.train.features": tmp_path / "features.py",
               "selfdraft.train": tmp_path / "__init__.py", "selfdraft.errors": tmp_path / "errors.py"}
    (tmp_path / "loop.py").write_text(
        "from selfdraft.errors import SelfdraftError\n"
        "def f():\n    from . import features\n"
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from selfdraft.train import nothing\n")
    assert imports_of("selfdraft.train.loop", modules["selfdraft.train.loop"], modules) == {
        "selfdraft.errors", "selfdraft.train.features"}
    graph = import_graph()
    assert "selfdraft.train.loop" in graph and "selfdraft.heads.target" in graph
    assert "selfdraft.inference.bench.run" in graph


def test_no_import_cycles_between_selfdraft_modules():
    found = cycles(import_graph())
    assert not found, "import cycles between selfdraft modules:\n" + "\n".join(" -> ".join(c) for c in found)
