"""The layering rules (docs/layering.py) hold on the real tree, and the scan catches each kind of violation.

The rules: the core never imports ``patchbay.plugins``; the scheduling side and the contract are device-free;
the toolkit sits below the worker; the worker never reaches up into the engine or the entry points, the engine
never into the entry points, and the entry points reach the engine only through its public API; inside the
worker, ``model/``, ``cpu/`` and ``parallel/`` keep to their own rooms; and every plugin imports only public
names (patchbay's ``__all__``, the interfaces, the contract, the toolkit's ``__all__``, its own package).
Fresh interpreters then check what importing the modules really loads.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from repo_paths import REPO_ROOT

from layering import (
    CORE,
    FORBIDDEN,
    PLUGINS,
    RUNNER_BUILD,
    RUNNER_STEP,
    WORKER,
    WORKER_ROOMS,
    module_name,
    under,
    plugin_scan,
    scan,
)

# -- the rules, on the real tree ----------------------------------------------------------------------------


def test_the_core_keeps_every_layering_rule():
    assert sorted(CORE.rglob("*.py")), f"no core modules found under {CORE}"
    violations = scan()
    assert violations == [], "layering rules broken:\n" + "\n".join(violations)


def test_every_top_level_entry_of_core_is_a_room_with_a_one_line_docstring():
    entries = sorted(p for p in CORE.iterdir() if p.name != "__pycache__")
    assert len(entries) <= 12, f"core/ has {len(entries)} entries at its top: {[p.name for p in entries]}"
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
        name for path in sorted(CORE.rglob("*.py")) if any(under(name := module_name(path), room) for room in rooms)
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
        ("worker-below-engine", "worker/model_runner.py", "from patchbay.engine.engine import Engine"),
        ("worker-below-engine", "worker/model_runner.py", "from patchbay.entrypoints.llm import LLM"),
        ("engine-below-entrypoints", "engine/engine.py", "from patchbay.entrypoints import cli"),
        ("entrypoints-use-engine-api", "entrypoints/llm.py", "from patchbay.engine.engine import Engine"),
        ("entrypoints-use-engine-api", "entrypoints/llm.py", "from patchbay.engine import engine"),
        ("entrypoints-use-engine-api", "entrypoints/llm.py", "from patchbay.worker.model.hf_model import HFCausalLM"),
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
        ("worker-model-stands-alone", "worker/model/vision.py", "from patchbay.worker.cpu import tuning"),
        (
            "worker-model-stands-alone",
            "worker/model/vision.py",
            "from ..cpu.caching_allocator import keep_freed_memory",
        ),
        (
            "worker-cpu-below-runner",
            "worker/cpu/fused_modules.py",
            "from patchbay.worker.model_runner import ModelRunner",
        ),
        ("worker-cpu-below-runner", "worker/cpu/fused_layer.py", "from .. import logprobs"),
        ("worker-cpu-below-runner", "worker/cpu/tuning.py", "import patchbay.worker.runner_build"),
        (
            "worker-cpu-below-runner",
            "worker/cpu/caching_allocator.py",
            "from patchbay.worker.parallel.distributed import RankSetup",
        ),
        (
            "worker-parallel-builds-runner-only",
            "worker/parallel/rank_worker.py",
            "from patchbay.worker.model_runner import ModelRunner",
        ),
        ("toolkit-below-worker", "toolkit/tiles.py", "from patchbay.worker.cpu.tuning import Tuning"),
        ("toolkit-below-worker", "toolkit/model_files.py", "from patchbay.scheduling.request import Request"),
        ("toolkit-below-worker", "toolkit/hidden_states.py", "import patchbay.engine"),
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
        ("engine/engine.py", "from patchbay.worker.model_runner import ModelRunner"),
        ("entrypoints/llm.py", "from patchbay.engine import Engine"),
        ("entrypoints/llm.py", "from patchbay.contract.settings import Settings"),
        ("contract/registry.py", "from patchbay.interfaces import Plugin"),
        ("contract/registry.py", "from . import hookspecs"),
        ("testing/suite.py", "from patchbay.scheduling.request import hash_block_tokens"),
        ("worker/model/hf_model.py", "from patchbay.toolkit.forward_context import attend"),
        ("worker/model/hf_model.py", "from . import vision"),
        ("worker/cpu/fused_modules.py", "from patchbay.toolkit.forward_context import attend"),
        ("worker/cpu/tuning.py", "from patchbay.toolkit.paths import cache_dir"),
        ("worker/cpu/fused_layer.py", "from .fused_modules import FusedRMSNorm"),
        ("worker/parallel/rank_worker.py", "from patchbay.worker.runner_build import RunnerSpec"),
        ("worker/parallel/rank_worker.py", "from patchbay.worker import runner_build"),
        ("worker/parallel/rank_worker.py", "from patchbay.worker.cpu.caching_allocator import keep_freed_memory"),
        ("worker/parallel/tensor_parallel.py", "from patchbay.worker.model.hf_model import HFCausalLM"),
        ("worker/runner_build.py", "from patchbay.worker.parallel.tensor_parallel import shard_model"),
        ("worker/model_runner.py", "from patchbay.worker.cpu.fused_modules import use_fused_ops"),
        ("toolkit/model_files.py", "from patchbay.contract.settings import DEFAULT_MODEL"),
        ("worker/cpu/quantization.py", "from patchbay.toolkit.tiles import TileLayout"),
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


# -- plugins rest on public names -----------------------------------------------------------------------------------


def test_every_plugin_imports_only_public_names():
    assert sorted(PLUGINS.rglob("*.py")), f"no plugin modules found under {PLUGINS}"
    violations = plugin_scan()
    assert violations == [], "plugins importing non-public patchbay names:\n" + "\n".join(violations)


def _write_plugin(plugins: Path, line: str) -> Path:
    module = plugins / "samplers" / "leaky.py"
    module.parent.mkdir(parents=True, exist_ok=True)
    (plugins / "__init__.py").touch()
    (module.parent / "__init__.py").touch()
    module.write_text(f'"""A plugin module."""\nimport importlib\n\n{line}\n')
    return module


@pytest.mark.parametrize(
    "line",
    [
        "from patchbay.worker.cpu.fused_modules import FusedModules",
        "from patchbay.worker.model.hf_model import HFCausalLM",
        "import patchbay.engine",
        "from patchbay.scheduling.request import Request",
        "from patchbay.toolkit.tiles import EXTENSION",  # a toolkit module's name outside its __all__
        "from patchbay.interfaces._private import helper",
        "from patchbay.contract.registry import _load",
        "from patchbay import SamplingParams, _internal",
        "from patchbay.plugins.attention.common import RowSplit",  # another plugin package's module
        "from ..attention import common",
        "importlib.import_module('patchbay.worker.model_runner')",
    ],
)
def test_the_plugin_scan_flags_a_non_public_import(tmp_path, line):
    module = _write_plugin(tmp_path / "plugins", line)
    (violation,) = plugin_scan(tmp_path / "plugins")
    assert violation.startswith(f"{module}:") and "[plugins-use-public-names]" in violation, violation


@pytest.mark.parametrize(
    "line",
    [
        "from patchbay import hookimpl",
        "import patchbay",
        "from patchbay.interfaces import Sampler, SamplerCapabilities",
        "from patchbay.interfaces.parsing import partial_marker_length",
        "from patchbay.contract.redaction import redact",
        "from patchbay.toolkit.fused_ops import argmax_rows",
        "from patchbay.toolkit import tiles",
        "from patchbay.plugins.samplers._processing import logits_processed",  # its own package
        "from ._processing import logits_processed",
        "import torch",
    ],
)
def test_the_plugin_scan_allows_public_names(tmp_path, line):
    _write_plugin(tmp_path / "plugins", line)
    assert plugin_scan(tmp_path / "plugins") == []
