"""The boundary rule: the core (``core/``, import package ``patchbay``) never imports ``patchbay.plugins``.

The core learns of plugins only through entry points.  Two checks enforce it:
a static scan of every core module's source, and a fresh interpreter that
imports every core module and finds no ``patchbay.plugins`` module loaded.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CORE = REPO_ROOT / "core"
CORE_PACKAGE = "patchbay"
FORBIDDEN = "patchbay.plugins"
_DYNAMIC_IMPORTERS = {"import_module", "__import__"}


def _is_forbidden(module: str) -> bool:
    return module == FORBIDDEN or module.startswith(FORBIDDEN + ".")


def module_name(path: Path, root: Path = CORE, package: str = CORE_PACKAGE) -> str:
    """``core/testing/suite.py`` -> ``patchbay.testing.suite``; ``core/__init__.py`` -> ``patchbay``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def _absolute(node: ast.ImportFrom, current: str, is_package: bool) -> str:
    """The module an ``ImportFrom`` reads from, with relative levels resolved against ``current``."""
    if node.level == 0:
        return node.module or ""
    base = current.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def plugin_imports(path: Path, root: Path = CORE, package: str = CORE_PACKAGE) -> list[str]:
    """Every place in the module at ``path`` that imports ``patchbay.plugins``, as ``file:line: what``.

    Catches ``import patchbay.plugins...``, ``from patchbay.plugins... import``,
    ``from patchbay import plugins``, relative forms of those, and
    ``importlib.import_module`` / ``__import__`` called with a
    ``"patchbay.plugins..."`` string literal.
    """
    current = module_name(path, root, package)
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        imported: list[str] = []
        if isinstance(node, ast.Import):
            imported = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, current, is_package)
            imported = [source] + [f"{source}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call):
            function = node.func
            name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
            if name in _DYNAMIC_IMPORTERS and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                imported = [node.args[0].value]
        for module in imported:
            if _is_forbidden(module):
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
                break
    return found


def scan(root: Path = CORE, package: str = CORE_PACKAGE) -> list[str]:
    """Every violation of the boundary rule under ``root`` (the source of import package ``package``)."""
    return [violation for path in sorted(root.rglob("*.py")) for violation in plugin_imports(path, root, package)]


# -- the rule ---------------------------------------------------------------------------------------------


def test_no_core_module_imports_the_plugins_package():
    assert sorted(CORE.rglob("*.py")), f"no core modules found under {CORE}"
    violations = scan()
    assert violations == [], "the core must not import patchbay.plugins:\n" + "\n".join(violations)


def test_importing_every_core_module_loads_no_plugin_module():
    modules = [module_name(path) for path in sorted(CORE.rglob("*.py"))]
    script = (
        "import importlib, json, sys, traceback\n"
        "errors = {}\n"
        f"for name in {modules!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        errors[name] = f'{type(exc).__name__}: {exc}'\n"
        f"loaded = sorted(m for m in sys.modules if m == {FORBIDDEN!r} or m.startswith({FORBIDDEN + '.'!r}))\n"
        "print(json.dumps({'loaded': loaded, 'errors': errors}))\n"
    )
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("PATCHBAY_") and key != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                            cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["errors"] == {}, f"core modules that fail to import: {report['errors']}"
    assert report["loaded"] == [], f"importing the core loaded plugin modules: {report['loaded']}"


# -- the scan itself fails on a violation ---------------------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        "import patchbay.plugins",
        "import patchbay.plugins.attention.reference as reference",
        "from patchbay.plugins.samplers.greedy import GreedySampler",
        "from patchbay.plugins import attention",
        "from patchbay import hookimpl, plugins",
        "from .. import plugins",  # in core/interfaces/: patchbay.plugins
        "from ..plugins.attention import hooks",
        "importlib.import_module('patchbay.plugins.attention.reference')",
        "module = import_module('patchbay.plugins')",
        "__import__('patchbay.plugins.samplers')",
        "def later():\n    from patchbay.plugins.samplers import greedy",
    ],
)
def test_the_scan_flags_a_core_module_that_imports_plugins(tmp_path, line):
    core = tmp_path / "core"
    (core / "interfaces").mkdir(parents=True)
    module = core / "interfaces" / "leaky.py"
    module.write_text(f'"""A core module that breaks the rule."""\nimport importlib\n\n{line}\n')

    (violation,) = scan(core)
    assert violation.startswith(f"{module}:")
    assert "plugins" in violation.split(": ", 1)[1]


@pytest.mark.parametrize(
    "line",
    [
        "import patchbay.registry",
        "from patchbay import hookimpl",
        "from patchbay.plugins_policy import deny",  # a different module that merely shares the prefix
        "from . import registry",
        "text = 'see patchbay.plugins.attention for the built-in backends'",
        "importlib.import_module(name)",  # a name from an entry point: the legitimate dynamic import
    ],
)
def test_the_scan_allows_what_the_rule_allows(tmp_path, line):
    core = tmp_path / "core"
    core.mkdir()
    (core / "fine.py").write_text(f"import importlib\n{line}\n")
    assert scan(core) == []


def test_relative_imports_resolve_against_the_module_package(tmp_path):
    core = tmp_path / "core"
    (core / "testing").mkdir(parents=True)
    (core / "__init__.py").write_text("from . import plugins\n")  # in the package itself: patchbay.plugins
    (core / "testing" / "__init__.py").write_text("from . import plugins\n")  # patchbay.testing.plugins: fine
    (violation,) = scan(core)
    assert violation.startswith(f"{core / '__init__.py'}:1: ")
