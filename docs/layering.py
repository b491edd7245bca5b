"""The layering rules: which room of ``core/`` may import which, and which patchbay names a plugin may import.

The rooms of ``core/`` (import package ``patchbay``) follow a request's path (docs/architecture.md); the rules
keep each room from reaching where it should not, and keep every plugin under ``plugins/`` resting on public
names only (:func:`plugin_scan`), as a third party's must.  tests/project/test_boundary.py checks the real tree
against them, and docs/rooms.py shows each room's imports in the architecture overview.

A static scan reads every module's imports (``import``, ``from ... import``, relative forms,
``importlib.import_module`` / ``__import__`` with a literal name); imports under ``if TYPE_CHECKING:`` count only
for the plugins rule.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CORE = REPO_ROOT / "core"
PLUGINS = REPO_ROOT / "plugins"
PLUGINS_PACKAGE = "patchbay.plugins"
CORE_PACKAGE = "patchbay"
FORBIDDEN = "patchbay.plugins"
DYNAMIC_IMPORTERS = {"import_module", "__import__"}
UPPER_ROOMS = ("patchbay.engine", "patchbay.entrypoints", "patchbay.bench", "patchbay.testing")
WORKER = CORE / "worker"


def _runner_step(worker: Path = WORKER) -> tuple[str, ...]:
    """The runner's step: every module at the top of ``worker/`` (a new one there belongs to the step)."""
    return tuple(f"patchbay.worker.{path.stem}" for path in sorted(worker.glob("*.py")) if path.stem != "__init__")


def _worker_rooms(worker: Path = WORKER) -> tuple[str, ...]:
    """The worker's rooms: its subpackages (``model``, ``cpu``, ``parallel``, ...)."""
    return tuple(f"patchbay.worker.{path.parent.name}" for path in sorted(worker.glob("*/__init__.py")))


RUNNER_STEP = _runner_step()
WORKER_ROOMS = _worker_rooms()
RUNNER_BUILD = "patchbay.worker.runner_build"
"""How the step is built from settings: the one step module a rank's process may use."""


@dataclass(frozen=True)
class Rule:
    """Modules under ``applies_to`` must not import modules under ``forbidden``."""

    name: str
    says: str
    applies_to: tuple[str, ...]
    forbidden: tuple[str, ...]
    type_checking_counts: bool = False
    public_api_of: str | None = None
    """A package whose submodules are forbidden and from which only the names in its ``__all__`` may be imported."""


RULES = (
    Rule(
        "no-plugins",
        "the core never imports patchbay.plugins (it learns of plugins through entry points)",
        ("patchbay",),
        (FORBIDDEN,),
        type_checking_counts=True,
    ),
    Rule(
        "scheduling-device-free",
        "the scheduling side imports neither torch nor the worker or the rooms above it",
        ("patchbay.scheduling",),
        ("torch", "patchbay.worker", *UPPER_ROOMS),
    ),
    Rule(
        "contract-device-free",
        "the contract imports neither torch nor the rooms that use it",
        ("patchbay.contract", "patchbay.interfaces", "patchbay.sampling_params"),
        ("torch", "patchbay.worker", "patchbay.scheduling", *UPPER_ROOMS),
    ),
    Rule(
        "toolkit-below-worker",
        "the public toolkit (what plugins and the worker share) imports neither the worker, the scheduling side nor "
        "the rooms above them",
        ("patchbay.toolkit",),
        ("patchbay.worker", "patchbay.scheduling", *UPPER_ROOMS),
    ),
    Rule(
        "worker-below-engine",
        "the worker never imports the engine or the entry points",
        ("patchbay.worker",),
        UPPER_ROOMS,
    ),
    Rule(
        "engine-below-entrypoints",
        "the engine never imports the entry points, the bench or the kit",
        ("patchbay.engine",),
        ("patchbay.entrypoints", "patchbay.bench", "patchbay.testing"),
    ),
    Rule(
        "entrypoints-use-engine-api",
        "the entry points reach the engine only through patchbay.engine's public API",
        ("patchbay.entrypoints",),
        ("patchbay.worker", "patchbay.scheduling"),
        public_api_of="patchbay.engine",
    ),
    Rule(
        "worker-model-stands-alone",
        "worker/model/ (finding, loading, wrapping models) imports nothing else of the worker: neither the runner's "
        "step nor another room",
        ("patchbay.worker.model",),
        (*RUNNER_STEP, *(room for room in WORKER_ROOMS if room != "patchbay.worker.model")),
    ),
    Rule(
        "worker-cpu-below-runner",
        "worker/cpu/ (CPU fast paths) imports neither the runner's step nor worker/parallel/",
        ("patchbay.worker.cpu",),
        (*RUNNER_STEP, "patchbay.worker.parallel"),
    ),
    Rule(
        "worker-parallel-builds-runner-only",
        "worker/parallel/ (one rank's side) reaches the runner's step only through runner_build, never its internals",
        ("patchbay.worker.parallel",),
        tuple(module for module in RUNNER_STEP if module != RUNNER_BUILD),
    ),
)


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


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


@dataclass(frozen=True)
class Import:
    """One import in a module: what it names and where."""

    node: ast.AST
    source: str
    """The module read from (``from X import a`` -> ``X``); for ``import X`` the module itself."""
    names: tuple[str, ...]
    """Names taken from ``source`` by ``from ... import``; empty for ``import X``."""
    type_checking: bool

    def modules(self) -> list[str]:
        """Every module this import may load: the source, and each name as a submodule of it."""
        return [self.source, *(f"{self.source}.{name}" for name in self.names)]


def _is_type_checking_guard(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def imports_of(path: Path, root: Path = CORE, package: str = CORE_PACKAGE) -> list[Import]:
    """Every import in the module at ``path``, static and literal-dynamic, in source order."""
    current = module_name(path, root, package)
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(node: ast.AST, type_checking: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(node, alias.name, (), type_checking) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names = tuple(alias.name for alias in node.names)
            found.append(Import(node, _absolute(node, current, is_package), names, type_checking))
        elif isinstance(node, ast.Call):
            function = node.func
            name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
            if (
                name in DYNAMIC_IMPORTERS
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                found.append(Import(node, node.args[0].value, (), type_checking))
        guarded = type_checking or _is_type_checking_guard(node)
        for child in ast.iter_child_nodes(node):
            # Only the body of ``if TYPE_CHECKING:`` is guarded, not its ``else``.
            in_else = isinstance(node, ast.If) and child in node.orelse
            visit(child, type_checking if in_else else guarded)

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return sorted(found, key=lambda item: (item.node.lineno, item.node.col_offset))


def module_api(module: str, root: Path = CORE, package_root: str = CORE_PACKAGE) -> set[str]:
    """The names in the literal ``__all__`` of ``module`` (a module or package under ``root``, the source of
    import package ``package_root``), read without importing it; empty when it declares none."""
    relative = module.removeprefix(package_root).strip(".").split(".")
    path = root.joinpath(*relative).with_suffix(".py") if relative != [""] else root / "__init__.py"
    if not path.is_file():
        path = root.joinpath(*relative, "__init__.py")
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(target, "id", None) == "__all__" for target in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def _breaks(rule: Rule, item: Import, root: Path, package: str) -> bool:
    if item.type_checking and not rule.type_checking_counts:
        return False
    if any(under(module, forbidden) for module in item.modules() for forbidden in rule.forbidden):
        return True
    api = rule.public_api_of
    if api is None:
        return False
    if under(item.source, api) and item.source != api:
        return True  # a submodule of the package: private
    if item.source == api and item.names:
        return not set(item.names) <= module_api(api, root, package)
    return False


def violations_in(
    path: Path, root: Path = CORE, package: str = CORE_PACKAGE, rules: tuple[Rule, ...] = RULES
) -> list[str]:
    """Every rule the module at ``path`` breaks, as ``file:line: [rule] what the rule says: the import``."""
    current = module_name(path, root, package)
    applicable = [rule for rule in rules if any(under(current, prefix) for prefix in rule.applies_to)]
    found = []
    for item in imports_of(path, root, package):
        for rule in applicable:
            if _breaks(rule, item, root, package):
                found.append(f"{path}:{item.node.lineno}: [{rule.name}] {rule.says}: {ast.unparse(item.node)}")
    return found


def scan(root: Path = CORE, package: str = CORE_PACKAGE, rules: tuple[Rule, ...] = RULES) -> list[str]:
    """Every violation of the layering rules under ``root`` (the source of import package ``package``)."""
    return [violation for path in sorted(root.rglob("*.py")) for violation in violations_in(path, root, package, rules)]


def plugin_imports(path: Path, root: Path = CORE, package: str = CORE_PACKAGE) -> list[str]:
    """The places in the module at ``path`` that import ``patchbay.plugins``."""
    return violations_in(path, root, package, RULES[:1])


# -- plugins rest on public names ------------------------------------------------------------------------------

PUBLIC_PACKAGES = ("patchbay.interfaces", "patchbay.contract", "patchbay.toolkit", "patchbay.sampling_params")
"""What a plugin may import from patchbay besides the names in ``patchbay.__all__`` and its own plugin package:
the interfaces, the contract and the toolkit (modules and names without a leading underscore; from a toolkit
module, only the names in its ``__all__``)."""

PLUGIN_RULE = "plugins-use-public-names"


def _public_name(name: str) -> bool:
    return not name.startswith("_")


def _is_public_import(item: Import, own_package: str) -> bool:
    """Whether a plugin module of ``own_package`` (``patchbay.plugins.samplers``) may make import ``item``."""
    source = item.source
    if not under(source, CORE_PACKAGE):
        return True  # not patchbay's
    if under(source, own_package):
        return True
    if source == CORE_PACKAGE:
        return set(item.names) <= module_api(CORE_PACKAGE)
    if not any(under(source, public) for public in PUBLIC_PACKAGES):
        return False
    if not all(_public_name(part) for part in source.split(".")) or not all(map(_public_name, item.names)):
        return False
    if under(source, "patchbay.toolkit") and source != "patchbay.toolkit" and item.names:
        return set(item.names) <= module_api(source)
    return True


def plugin_scan(root: Path = PLUGINS, package: str = PLUGINS_PACKAGE) -> list[str]:
    """Every import of a patchbay name that is not public in the plugins under ``root`` (import package
    ``package``), as ``file:line: [plugins-use-public-names] ...: the import``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        own = f"{package}.{parts[0]}" if len(parts) > 1 else package
        for item in imports_of(path, root, package):
            if not _is_public_import(item, own):
                found.append(
                    f"{path}:{item.node.lineno}: [{PLUGIN_RULE}] a plugin imports only public names (patchbay's "
                    f"__all__, the interfaces, the contract, the toolkit's __all__, its own package): "
                    f"{ast.unparse(item.node)}"
                )
    return found


def room_imports(module_paths: list[Path], root: Path, package: str, room: str) -> list[str]:
    """The rooms of patchbay (``patchbay.X``, or ``patchbay`` itself) that the modules of package ``room`` import,
    its own package left out; ``root`` is the source folder of import package ``package``."""
    rooms: set[str] = set()
    for path in module_paths:
        for item in imports_of(path, root, package):
            if item.type_checking or not under(item.source, CORE_PACKAGE) or under(item.source, room):
                continue
            parts = item.source.split(".")
            rooms.add(".".join(parts[:2]) if len(parts) > 1 else parts[0])
    return sorted(rooms)
