"""Imports flow one way: ``api -> jobs <- worker -> kernels`` (docs/architecture.md, "Packages").

The engine (``worker.engine``) is a library of its own: it imports neither ``jobs`` nor ``api`` nor the
rest of ``worker``, and its modules import each other without cycles. Module-level imports are read
from the source (``ast``); imports under ``if TYPE_CHECKING:`` are for annotations only and skipped.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "jobs", "worker", "kernels")
# Which of our top-level packages each package may import (besides itself).
ALLOWED = {"api": {"jobs"}, "jobs": set(), "worker": {"jobs", "kernels"}, "kernels": set()}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(path): path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if "__pycache__" not in path.parts
    }


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements that run at import time, descending into ``if``/``try`` but not functions or classes."""
    nodes: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If):
            if not _is_type_checking(node):
                nodes += _runtime_nodes(node.body) + _runtime_nodes(node.orelse)
        elif isinstance(node, ast.Try):
            nodes += _runtime_nodes(node.body) + _runtime_nodes(node.orelse) + _runtime_nodes(node.finalbody)
            for handler in node.handlers:
                nodes += _runtime_nodes(handler.body)
        else:
            nodes.append(node)
    return nodes


def _all_imports(tree: ast.Module) -> list[str]:
    """Every module named by an import anywhere in the file (functions included), resolved to our modules."""
    return [name for node in ast.walk(tree) for name in _imported(node)]


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        # `from a.b import c` names module a.b.c when that is one of ours, else a.b.
        return [
            f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module
            for alias in node.names
        ]
    return []


def _top_level_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [name for node in _runtime_nodes(tree.body) for name in _imported(node)]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_flow_one_way(module):
    package = module.split(".")[0]
    tree = ast.parse(MODULES[module].read_text())
    ours = {name.split(".")[0] for name in _all_imports(tree)} & set(PACKAGES)
    assert ours <= ALLOWED[package] | {package}, f"{module} imports {sorted(ours - ALLOWED[package] - {package})}"
    if module.startswith("worker.engine"):
        outside = {
            name
            for name in _all_imports(tree)
            if name.split(".")[0] in PACKAGES and not name.startswith(("worker.engine", "kernels"))
        }
        assert not outside, f"the engine module {module} imports {sorted(outside)}"


def test_the_engine_has_no_import_cycles():
    engine = {name: path for name, path in MODULES.items() if name.startswith("worker.engine")}
    graph = {
        name: {dep for dep in _top_level_imports(path) if dep in engine and dep != name}
        for name, path in engine.items()
    }
    state: dict[str, str] = {}

    def visit(name: str, stack: list[str]) -> None:
        state[name] = "active"
        for dep in sorted(graph[name]):
            if state.get(dep) == "active":
                cycle = stack[stack.index(dep) :] + [dep] if dep in stack else [name, dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, stack + [dep])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_the_checker_sees_a_cycle_and_a_forbidden_import(tmp_path):
    """The parsing helpers above are what the two tests rely on: they must see real imports."""
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import jobs.models\nimport worker.engine.config\n"
    )
    path = tmp_path / "mod.py"
    path.write_text(source)
    assert _top_level_imports(path) == ["typing", "worker.engine.config"]
    assert "jobs.models" in _all_imports(ast.parse(source))
