"""The layering rules of the core (``core/``, import package ``patchbay``), each a checked rule.

The rooms of ``core/`` follow a request's path (docs/architecture.md); these
rules keep each room from reaching where it should not:

- the core never imports ``patchbay.plugins`` (it learns of plugins only through entry points);
- the scheduling side is device-free: no torch, nothing from the worker or above;
- the contract (``contract``, ``interfaces``, ``sampling_params``) imports neither torch nor the rooms that use it;
- the worker never reaches up into the engine or the entry points;
- the engine never reaches up into the entry points;
- the entry points reach the engine only through its public API (names in ``patchbay.engine.__all__``);
- inside the worker, the runner's step (the modules at the top of ``worker/``) may use every room, but
  ``worker/model/`` imports nothing else of the worker, ``worker/cpu/`` neither the step nor ``parallel/`` (its
  fused layers attend through ``model/``'s forward context), and ``worker/parallel/`` reaches the step
  only through ``runner_build`` (building its rank's runner), never the runner's internals.

A static scan reads every module's imports (``import``, ``from ... import``,
relative forms, ``importlib.import_module`` / ``__import__`` with a literal
name); imports under ``if TYPE_CHECKING:`` count only for the plugins rule.
Fresh interpreters then check what importing the modules really loads.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CORE = REPO_ROOT / "core"
CORE_PACKAGE = "patchbay"
FORBIDDEN = "patchbay.plugins"
_DYNAMIC_IMPORTERS = {"import_module", "__import__"}
_UPPER_ROOMS = ("patchbay.engine", "patchbay.entrypoints", "patchbay.bench", "patchbay.testing")
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
        ("torch", "patchbay.worker", *_UPPER_ROOMS),
    ),
    Rule(
        "contract-device-free",
        "the contract imports neither torch nor the rooms that use it",
        ("patchbay.contract", "patchbay.interfaces", "patchbay.sampling_params"),
        ("torch", "patchbay.worker", "patchbay.scheduling", *_UPPER_ROOMS),
    ),
    Rule(
        "worker-below-engine",
        "the worker never imports the engine or the entry points",
        ("patchbay.worker",),
        _UPPER_ROOMS,
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


def _under(module: str, prefix: str) -> bool:
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
                name in _DYNAMIC_IMPORTERS
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


def _public_api(package: str, root: Path, package_root: str) -> set[str]:
    """The names in the literal ``__all__`` of ``package`` (a package under ``root``), read without importing it."""
    relative = package.removeprefix(package_root).strip(".").split(".")
    tree = ast.parse(root.joinpath(*relative, "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(target, "id", None) == "__all__" for target in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def _breaks(rule: Rule, item: Import, root: Path, package: str) -> bool:
    if item.type_checking and not rule.type_checking_counts:
        return False
    if any(_under(module, forbidden) for module in item.modules() for forbidden in rule.forbidden):
        return True
    api = rule.public_api_of
    if api is None:
        return False
    if _under(item.source, api) and item.source != api:
        return True  # a submodule of the package: private
    if item.source == api and item.names:
        return not set(item.names) <= _public_api(api, root, package)
    return False


def violations_in(
    path: Path, root: Path = CORE, package: str = CORE_PACKAGE, rules: tuple[Rule, ...] = RULES
) -> list[str]:
    """Every rule the module at ``path`` breaks, as ``file:line: [rule] what the rule says: the import``."""
    current = module_name(path, root, package)
    applicable = [rule for rule in rules if any(_under(current, prefix) for prefix in rule.applies_to)]
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


# -- the rules, on the real tree ----------------------------------------------------------------------------


def test_the_core_keeps_every_layering_rule():
    assert sorted(CORE.rglob("*.py")), f"no core modules found under {CORE}"
    violations = scan()
    assert violations == [], "layering rules broken:\n" + "\n".join(violations)


def test_every_top_level_entry_of_core_is_a_room_with_a_one_line_docstring():
    entries = sorted(p for p in CORE.iterdir() if p.name != "__pycache__")
    assert len(entries) <= 11, f"core/ has {len(entries)} entries at its top: {[p.name for p in entries]}"
    for entry in entries:
        source = entry / "__init__.py" if entry.is_dir() else entry
        docstring = ast.get_docstring(ast.parse(source.read_text()))
        assert docstring, f"{source} has no docstring saying what lives there"


def test_the_worker_rules_name_the_step_and_the_rooms():
    # The worker's rules are computed from the tree: this keeps them from going vacuous.
    assert {"patchbay.worker.model_runner", "patchbay.worker.input_batch", RUNNER_BUILD} <= set(RUNNER_STEP)
    assert {"patchbay.worker.model", "patchbay.worker.cpu", "patchbay.worker.parallel"} <= set(WORKER_ROOMS)


def test_every_room_of_the_worker_is_a_package_with_a_one_line_docstring():
    rooms = sorted(path for path in WORKER.iterdir() if path.is_dir() and path.name != "__pycache__")
    assert rooms, f"no rooms under {WORKER}"
    for room in rooms:
        source = room / "__init__.py"
        assert source.is_file(), f"{room} holds no __init__.py: each room of the worker is a package"
        docstring = ast.get_docstring(ast.parse(source.read_text()))
        assert docstring and "\n" not in docstring.strip(), (
            f"{source} needs a one-line docstring saying what lives there"
        )


def _fresh_import(modules: list[str], watched: list[str]) -> dict:
    """Import ``modules`` in a fresh interpreter; report failures and which ``watched`` packages got loaded."""
    script = (
        "import importlib, json, sys\n"
        "errors = {}\n"
        f"for name in {modules!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        errors[name] = f'{type(exc).__name__}: {exc}'\n"
        f"watched = {watched!r}\n"
        "loaded = sorted(m for m in sys.modules if any(m == w or m.startswith(w + '.') for w in watched))\n"
        "print(json.dumps({'loaded': loaded, 'errors': errors}))\n"
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith("PATCHBAY_") and key != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_every_core_module_loads_no_plugin_module():
    report = _fresh_import([module_name(path) for path in sorted(CORE.rglob("*.py"))], [FORBIDDEN])
    assert report["errors"] == {}, f"core modules that fail to import: {report['errors']}"
    assert report["loaded"] == [], f"importing the core loaded plugin modules: {report['loaded']}"


def test_importing_the_device_free_rooms_loads_no_torch():
    rooms = ("patchbay.scheduling", "patchbay.contract", "patchbay.interfaces", "patchbay.sampling_params")
    modules = [
        name for path in sorted(CORE.rglob("*.py")) if any(_under(name := module_name(path), room) for room in rooms)
    ]
    report = _fresh_import(modules, ["torch", "patchbay.worker"])
    assert report["errors"] == {}
    assert report["loaded"] == [], f"the device-free rooms loaded: {report['loaded'][:10]}"


# -- the scan fails on a violation, naming the rule ---------------------------------------------------------


def _write(core: Path, relative: str, line: str) -> Path:
    module = core / relative
    module.parent.mkdir(parents=True, exist_ok=True)
    for parent in module.relative_to(core).parents:
        (core / parent / "__init__.py").touch()
    module.write_text(f'"""A core module that breaks a rule."""\nimport importlib\n\n{line}\n')
    return module


def _engine_api(core: Path) -> None:
    (core / "engine").mkdir(parents=True, exist_ok=True)
    (core / "engine" / "__init__.py").write_text('__all__ = ["Engine"]\n')


@pytest.mark.parametrize(
    "where, line",
    [
        ("interfaces/leaky.py", "import patchbay.plugins"),
        ("interfaces/leaky.py", "import patchbay.plugins.attention.reference as reference"),
        ("worker/leaky.py", "from patchbay.plugins.samplers.greedy import GreedySampler"),
        ("leaky.py", "from patchbay.plugins import attention"),
        ("leaky.py", "from patchbay import hookimpl, plugins"),
        ("interfaces/leaky.py", "from .. import plugins"),
        ("interfaces/leaky.py", "from ..plugins.attention import hooks"),
        ("leaky.py", "importlib.import_module('patchbay.plugins.attention.reference')"),
        ("leaky.py", "module = import_module('patchbay.plugins')"),
        ("leaky.py", "__import__('patchbay.plugins.samplers')"),
        ("leaky.py", "def later():\n    from patchbay.plugins.samplers import greedy"),
        ("scheduling/leaky.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import patchbay.plugins"),
    ],
)
def test_the_scan_flags_a_core_module_that_imports_plugins(tmp_path, where, line):
    module = _write(tmp_path / "core", where, line)
    (violation,) = scan(tmp_path / "core")
    assert violation.startswith(f"{module}:")
    assert "[no-plugins]" in violation and "plugins" in violation.split("]", 1)[1]


@pytest.mark.parametrize(
    "rule, where, line",
    [
        ("scheduling-device-free", "scheduling/scheduler.py", "import torch"),
        ("scheduling-device-free", "scheduling/scheduler.py", "def f():\n    import torch.nn.functional as F"),
        ("scheduling-device-free", "scheduling/request.py", "from patchbay.worker.input_batch import InputBatch"),
        ("scheduling-device-free", "scheduling/request.py", "from ..worker import model_runner"),
        ("scheduling-device-free", "scheduling/request.py", "from patchbay.engine import Engine"),
        ("contract-device-free", "contract/registry.py", "import torch"),
        ("contract-device-free", "contract/settings.py", "from patchbay.scheduling.request import Request"),
        ("contract-device-free", "interfaces/attention.py", "from torch import Tensor"),
        ("contract-device-free", "sampling_params.py", "from patchbay.worker.model import hf_model"),
        ("worker-below-engine", "worker/model_runner.py", "from patchbay.engine.core import Engine"),
        ("worker-below-engine", "worker/model_runner.py", "from patchbay.entrypoints.llm import LLM"),
        ("engine-below-entrypoints", "engine/core.py", "from patchbay.entrypoints import cli"),
        ("entrypoints-use-engine-api", "entrypoints/llm.py", "from patchbay.engine.core import Engine"),
        ("entrypoints-use-engine-api", "entrypoints/llm.py", "from patchbay.engine import core"),
        (
            "entrypoints-use-engine-api",
            "entrypoints/llm.py",
            "from patchbay.worker.model.model_loader import ModelLoadError",
        ),
        ("entrypoints-use-engine-api", "entrypoints/cli.py", "from patchbay.scheduling.scheduler import Scheduler"),
        ("entrypoints-use-engine-api", "entrypoints/cli.py", "import patchbay.engine.outputs"),
        (
            "worker-model-stands-alone",
            "worker/model/hf_model.py",
            "from patchbay.worker.model_runner import ModelRunner",
        ),
        ("worker-model-stands-alone", "worker/model/hf_model.py", "from patchbay.worker import input_batch"),
        (
            "worker-model-stands-alone",
            "worker/model/hf_model.py",
            "def f():\n    from patchbay.worker.parallel.pipeline_parallel import PassThroughLayer",
        ),
        ("worker-model-stands-alone", "worker/model/model_loader.py", "from patchbay.worker.cpu import tuning"),
        ("worker-model-stands-alone", "worker/model/model_loader.py", "from ..cpu.heap import keep_freed_memory"),
        ("worker-cpu-below-runner", "worker/cpu/fused_ops.py", "from patchbay.worker.model_runner import ModelRunner"),
        ("worker-cpu-below-runner", "worker/cpu/fused_layer.py", "from .. import logprobs"),
        ("worker-cpu-below-runner", "worker/cpu/tuning.py", "import patchbay.worker.runner_build"),
        ("worker-cpu-below-runner", "worker/cpu/heap.py", "from patchbay.worker.parallel.distributed import RankSetup"),
        (
            "worker-parallel-builds-runner-only",
            "worker/parallel/rank_worker.py",
            "from patchbay.worker.model_runner import ModelRunner",
        ),
        ("worker-parallel-builds-runner-only", "worker/parallel/rank_worker.py", "from .. import input_batch"),
        (
            "worker-parallel-builds-runner-only",
            "worker/parallel/tensor_parallel.py",
            "importlib.import_module('patchbay.worker.sampling_state')",
        ),
    ],
)
def test_the_scan_flags_each_layering_rule_by_name(tmp_path, rule, where, line):
    core = tmp_path / "core"
    _engine_api(core)
    module = _write(core, where, line)
    (violation,) = scan(core)
    assert violation.startswith(f"{module}:")
    assert f"[{rule}]" in violation, violation


@pytest.mark.parametrize(
    "where, line",
    [
        ("scheduling/request.py", "import numpy as np"),
        ("scheduling/request.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch"),
        ("scheduling/scheduler.py", "from patchbay.interfaces import KVConnectorScheduler"),
        ("worker/model_runner.py", "from patchbay.scheduling.scheduler_output import SchedulerOutput"),
        ("engine/core.py", "from patchbay.worker.model_runner import ModelRunner"),
        ("entrypoints/llm.py", "from patchbay.engine import Engine"),
        ("entrypoints/llm.py", "from patchbay.contract.settings import Settings"),
        ("contract/registry.py", "from patchbay.interfaces import Plugin"),
        ("contract/registry.py", "from . import hookspecs"),
        ("testing/suite.py", "from patchbay.scheduling.request import hash_block_tokens"),
        ("worker/model/hf_model.py", "from patchbay.worker.model.forward_context import attend"),
        ("worker/model/hf_model.py", "from . import model_loader"),
        ("worker/cpu/fused_ops.py", "from patchbay.worker.model.forward_context import attend"),
        ("worker/cpu/native_build.py", "from patchbay.worker.model.model_loader import cache_dir"),
        ("worker/cpu/fused_layer.py", "from .fused_ops import FusedRMSNorm"),
        ("worker/parallel/rank_worker.py", "from patchbay.worker.runner_build import RunnerSpec"),
        ("worker/parallel/rank_worker.py", "from patchbay.worker import runner_build"),
        ("worker/parallel/rank_worker.py", "from patchbay.worker.cpu.heap import keep_freed_memory"),
        ("worker/parallel/tensor_parallel.py", "from patchbay.worker.model.hf_model import HFCausalLM"),
        ("worker/runner_build.py", "from patchbay.worker.parallel.tensor_parallel import shard_model"),
        ("worker/model_runner.py", "from patchbay.worker.cpu.fused_ops import use_fused_ops"),
    ],
)
def test_the_scan_allows_what_the_rules_allow(tmp_path, where, line):
    core = tmp_path / "core"
    _engine_api(core)
    _write(core, where, line)
    assert scan(core) == []


@pytest.mark.parametrize(
    "line",
    [
        "import patchbay.contract.registry",
        "from patchbay import hookimpl",
        "from patchbay.plugins_policy import deny",  # a different module that merely shares the prefix
        "from . import registry",
        "text = 'see patchbay.plugins.attention for the built-in backends'",
        "importlib.import_module(name)",  # a name from an entry point: the legitimate dynamic import
    ],
)
def test_the_plugins_rule_allows_what_it_allows(tmp_path, line):
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
