"""Packaging: a plain wheel of the repository holds the core, the plugins and the entry points.

The wheel is built from a copy of the sources (pip builds in-tree), offline,
with the venv's setuptools (``--no-build-isolation``).
"""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from repo_paths import REPO_ROOT

PACKAGE_DIRS = {"core": "patchbay", "plugins": "patchbay/plugins"}
"""Source directory -> its path in the wheel (the package-dir mapping of pyproject.toml)."""


def _pip(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("PATCHBAY_") and key != "PYTHONPATH"}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    result = subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600
    )
    assert result.returncode == 0, f"pip {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip wheel --no-deps --no-build-isolation`` of a copy of the repository."""
    source = tmp_path_factory.mktemp("source") / "patchbay"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "setup.cfg", "MANIFEST.in"):
        if (REPO_ROOT / name).exists():
            shutil.copy2(REPO_ROOT / name, source / name)
    for directory in PACKAGE_DIRS:
        shutil.copytree(
            REPO_ROOT / directory,
            source / directory,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"),
        )
    out = tmp_path_factory.mktemp("wheelhouse")
    _pip("wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(out), str(source))
    (built,) = out.glob("patchbay-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def _entry_points(wheel: Path) -> configparser.ConfigParser:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [name for name in archive.namelist() if name.endswith(".dist-info/entry_points.txt")]
        parser = configparser.ConfigParser(delimiters=("=",))
        parser.optionxform = str  # entry-point names are case-sensitive
        parser.read_string(archive.read(name).decode())
    return parser


def test_the_wheel_holds_the_core_the_plugins_and_the_kit(wheel_files):
    for expected in (
        "patchbay/entrypoints/cli.py",
        "patchbay/contract/registry.py",
        "patchbay/scheduling/scheduler.py",
        "patchbay/worker/model_runner.py",
        "patchbay/engine/engine.py",
        "patchbay/toolkit/tiles.py",
        "patchbay/toolkit/csrc/tiles.cpp",
        "patchbay/interfaces/attention.py",
        "patchbay/plugins/attention/hooks.py",
        "patchbay/plugins/samplers/hooks.py",
        "patchbay/plugins/spec_decode/hooks.py",
        "patchbay/testing/suite.py",
        "patchbay/testing/pytest_plugin.py",
    ):
        assert expected in wheel_files, f"{expected} missing from the wheel"


def test_every_source_module_is_in_the_wheel(wheel_files):
    # Catches a new subpackage left out of the explicit `packages` list in pyproject.toml.
    missing = []
    for directory, prefix in PACKAGE_DIRS.items():
        for path in sorted((REPO_ROOT / directory).rglob("*.py")):
            in_wheel = f"{prefix}/{path.relative_to(REPO_ROOT / directory).as_posix()}"
            if in_wheel not in wheel_files:
                missing.append(in_wheel)
    assert missing == [], f"modules missing from the wheel (add their packages to pyproject.toml): {missing}"
    assert not any(name.startswith(("core/", "plugins/", "tests/")) for name in wheel_files)


def test_every_kernel_source_is_in_the_wheel(wheel_files):
    # The C++ kernels compile on the installing machine from package data ([tool.setuptools.package-data]).
    sources, missing = [], []
    for directory, prefix in PACKAGE_DIRS.items():
        for path in sorted((REPO_ROOT / directory).rglob("*")):
            if path.suffix in (".cpp", ".h"):
                sources.append(path)
                in_wheel = f"{prefix}/{path.relative_to(REPO_ROOT / directory).as_posix()}"
                if in_wheel not in wheel_files:
                    missing.append(in_wheel)
    assert sources, "no C++ sources found"
    assert missing == [], f"C++ sources missing from the wheel (add them to pyproject's package data): {missing}"


def test_the_wheel_declares_the_entry_points(wheel, wheel_files):
    entry_points = _entry_points(wheel)
    assert entry_points["console_scripts"]["patchbay"] == "patchbay.entrypoints.cli:main"
    assert entry_points["pytest11"]["patchbay"] == "patchbay.testing.pytest_plugin"
    plugins = dict(entry_points["patchbay"])
    assert plugins["attention"] == "patchbay.plugins.attention.hooks"
    assert plugins["samplers"] == "patchbay.plugins.samplers.hooks"
    assert plugins["spec_decode"] == "patchbay.plugins.spec_decode.hooks"
    for name, module in plugins.items():
        assert module.startswith("patchbay.plugins."), f"built-in plugin {name!r} lives outside patchbay.plugins"
        assert f"{module.replace('.', '/')}.py" in wheel_files, f"entry point {name} = {module}: module not in wheel"


def test_an_install_of_the_wheel_imports_the_same_names(wheel, tmp_path):
    target = tmp_path / "site"
    _pip("install", "--no-deps", "--target", str(target), str(wheel))
    script = """
import importlib.metadata, json, sys
import patchbay, patchbay.contract.registry, patchbay.testing, patchbay.entrypoints.cli
import patchbay.plugins.samplers.hooks
from patchbay.contract.registry import Registry

(dist,) = importlib.metadata.distributions(path=[sys.argv[1]])
registry = Registry.from_entry_points(entry_points=dist.entry_points.select(group="patchbay"))
greedy = registry.resolve("sampler", "greedy")
print(json.dumps({
    "files": {name: sys.modules[name].__file__ for name in
              ["patchbay", "patchbay.contract.registry", "patchbay.plugins.samplers.hooks", greedy.__module__]},
    "greedy": f"{greedy.__module__}:{greedy.__qualname__}",
    "version": dist.version,
    "failures": [str(failure) for failure in registry.failures],
}))
"""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PATCHBAY_")}
    env["PYTHONPATH"] = str(target)  # ahead of the venv's editable install
    result = subprocess.run(
        [sys.executable, "-c", script, str(target)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])

    for name, file in report["files"].items():
        assert file.startswith(str(target)), f"{name} imported from {file}, not from the wheel install"
    assert report["greedy"] == "patchbay.plugins.samplers.greedy:GreedySampler"
    assert report["failures"] == []
    import patchbay

    assert report["version"] == patchbay.__version__
