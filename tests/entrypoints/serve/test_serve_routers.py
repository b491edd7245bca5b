"""The server's seams: one router module per API over shared plumbing, with no import cycle among the server's
modules and no module importing another's private names (issue 50: ``app.py`` and ``responses.py`` imported
each other through ``_prepare`` and ``_check_model``)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SERVE = Path(__file__).resolve().parents[3] / "core" / "entrypoints" / "serve"
PACKAGE = "patchbay.entrypoints.serve"
ROUTERS = ("admin_routes", "completion_routes", "model_routes", "response_routes")


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of each import in ``path`` that reaches into patchbay (names empty for ``import x``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("patchbay"):
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.startswith("patchbay")]
    return found


def _serve_graph(folder: Path) -> dict[str, set[str]]:
    """Each module of the server package -> the modules of the package it imports."""
    modules = {path.stem for path in folder.glob("*.py") if path.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for stem in modules:
        edges = set()
        for module, names in _imports(folder / f"{stem}.py"):
            if module.startswith(PACKAGE + "."):
                edges.add(module.removeprefix(PACKAGE + ".").split(".")[0])
            elif module == PACKAGE:
                edges.update(name for name in names if name in modules)
        graph[stem] = edges & modules
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated at the end), or ``None``."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for after in sorted(graph[node]):
            if state.get(after) == "open":
                return [*path[path.index(after) :], after] if after in path else [node, after]
            if after not in state:
                found = visit(after, [*path, after])
                if found:
                    return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def _private_imports(folder: Path) -> list[str]:
    """``file: from module import _name`` for each private name a server module takes from another module."""
    return [
        f"{path.name}: from {module} import {name}"
        for path in sorted(folder.glob("*.py"))
        for module, names in _imports(path)
        for name in names
        if name.startswith("_")
    ]


def test_the_server_s_modules_import_no_cycle_and_no_private_name():
    assert _cycle(_serve_graph(SERVE)) is None, f"import cycle: {' -> '.join(_cycle(_serve_graph(SERVE)) or [])}"
    assert _private_imports(SERVE) == []


def test_the_checks_name_a_cycle_and_a_private_import(tmp_path):
    """The scan is shown failing: a module pair that imports each other, one through a private name."""
    (tmp_path / "first.py").write_text(f"from {PACKAGE}.second import _helper\n")
    (tmp_path / "second.py").write_text(f"from {PACKAGE} import first\n")
    assert _cycle(_serve_graph(tmp_path)) in (["first", "second", "first"], ["second", "first", "second"])
    assert _private_imports(tmp_path) == [f"first.py: from {PACKAGE}.second import _helper"]


@pytest.mark.parametrize("router", ROUTERS)
def test_each_router_imports_alone_in_a_fresh_interpreter(router):
    module = f"{PACKAGE}.{router}"
    result = subprocess.run(
        [sys.executable, "-c", f"import {module}; print({module}.__name__)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == module
