"""Shared fixtures of the patchbay test suite.

Each group below is self-contained; add new groups rather than growing one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from shared_engines import SharedEngines

TESTS_DIR = Path(__file__).resolve().parent

# `model.dtype: auto` is the fastest dtype this machine's CPU computes natively (measured), which differs
# from one machine to the next; parity with transformers is checked in float32, so the suite pins it.
# Tests that mean another dtype say so; tests of `auto` itself remove this variable.
os.environ.setdefault("PATCHBAY_MODEL__DTYPE", "float32")

# `cache.memory: auto` gives a CPU engine half the machine for its KV pool, touched block by block as requests
# use it; engines shared for the whole session touch more and more of it (CI saw one test process at 11.8 GiB).
# The suite's requests need a small share: pinning it keeps the session's peak low. Tests of the sizing
# itself give their own figures.
os.environ.setdefault("PATCHBAY_CACHE__MEMORY_UTILIZATION", "0.15")

# Inherited by every process the session starts (orphans keep it), so a test can tell its own rank processes
# from another session's on the same machine. Not PATCHBAY_*: those are settings, and clean_env drops them.
os.environ.setdefault("PYTEST_PATCHBAY_SESSION", uuid.uuid4().hex)


# ------------------------------------------------------------------------------------------------
# Third-party plugin packages and the `patchbay` command line
#
# tests/example_plugin, tests/broken_plugin and tests/duplicate_plugin are real distributions with
# their own pyproject.toml.  `plugin_site` pip-installs them into a temporary directory (never into
# the venv); a process started with PYTHONPATH=<site> sees their `patchbay` entry points exactly
# as it would after `pip install patchbay-example-plugin`.
# ------------------------------------------------------------------------------------------------

PLUGIN_PACKAGES = (TESTS_DIR / "example_plugin", TESTS_DIR / "broken_plugin", TESTS_DIR / "duplicate_plugin")
DENY_BROKEN_AND_DUPLICATE = "patchbay-broken-plugin,patchbay-duplicate-plugin"
"""PATCHBAY_PLUGINS__DENY value that leaves the built-ins and the example plugin: a clean registry."""


def pip_install_into(target: Path, packages: Iterable[Path]) -> None:
    """``pip install --no-deps --no-build-isolation --target target packages...`` with this interpreter, offline."""
    env = clean_env(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        "--target",
        str(target),
        *(str(package) for package in packages),
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")


def clean_env(site: Path | None = None, **overrides: str) -> dict[str, str]:
    """This process's environment without PATCHBAY_* settings and PYTHONPATH, plus ``overrides``.

    With ``site``, PYTHONPATH points at it so its distributions' entry points are discovered.
    """
    env = {key: value for key, value in os.environ.items() if not key.startswith("PATCHBAY_") and key != "PYTHONPATH"}
    if site is not None:
        env["PYTHONPATH"] = str(site)
    env.update(overrides)
    return env


def patchbay_command() -> list[str]:
    """The installed ``patchbay`` console script next to this interpreter.

    Where there is none, ``python -m patchbay.entrypoints.cli``.
    """
    script = Path(sys.executable).with_name("patchbay")
    return [str(script)] if script.exists() else [sys.executable, "-m", "patchbay.entrypoints.cli"]


def run_patchbay(
    *args: str, site: Path | None, env: Mapping[str, str] | None = None, cwd: Path | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``patchbay ARGS...`` in a subprocess that sees the distributions installed in ``site``."""
    return subprocess.run(
        [*patchbay_command(), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean_env(site, **dict(env or {})),
        cwd=cwd,
    )


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding installs of the example, broken and duplicate plugin distributions."""
    sources = tmp_path_factory.mktemp("plugin-sources")
    copies = []
    for package in PLUGIN_PACKAGES:
        # Build from a copy, so pip's in-tree build leaves no build/ or *.egg-info in tests/.
        copy = sources / package.name
        shutil.copytree(package, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        copies.append(copy)
    site = tmp_path_factory.mktemp("plugin-site")
    pip_install_into(site, copies)
    return site


@pytest.fixture(scope="session")
def patchbay_cli(plugin_site: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``patchbay_cli("plugins", "--json", env={...})`` runs the CLI with the plugin packages installed."""

    def run(
        *args: str, env: Mapping[str, str] | None = None, cwd: Path | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        return run_patchbay(*args, site=plugin_site, env=env, cwd=cwd, timeout=timeout)

    return run


@pytest.fixture(scope="session")
def example_only_env() -> dict[str, str]:
    """Environment for a registry of the built-ins and the example plugin only (broken and duplicate denied)."""
    return {"PATCHBAY_PLUGINS__DENY": DENY_BROKEN_AND_DUPLICATE}


# ------------------------------------------------------------------------------------------------
# A cache directory of a test's own
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def own_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh ``$PATCHBAY_CACHE_DIR`` for one test, sharing the session's built kernels and CPU tunings.

    An engine built with an empty cache compiles the C++ kernels and measures the CPU again: a minute or
    more per test, for what the test does not look at.
    """
    from patchbay.worker.model.model_loader import cache_dir

    shared = cache_dir()
    own = tmp_path / "cache"
    own.mkdir()
    for folder in ("kernels", "tuning"):
        (shared / folder).mkdir(parents=True, exist_ok=True)
        (own / folder).symlink_to(shared / folder, target_is_directory=True)
    monkeypatch.setenv("PATCHBAY_CACHE_DIR", str(own))
    return own


# ------------------------------------------------------------------------------------------------
# Tiny random-weight models (see tests/tiny_models.py)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer Llama with grouped-query attention (8 query heads, 2 KV heads), built once per session."""
    from tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama-gqa4")


@pytest.fixture(scope="session")
def tiny_qwen2_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2-VL (M-RoPE) saved with its tokenizer and image processor, built once per session."""
    from mm_models import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2-vl"))


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LLaVA (CLIP vision tower, Llama text model) saved with its processor, built once per session."""
    from mm_models import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("llava"))


# ------------------------------------------------------------------------------------------------
# Engines shared by the tests that only read them (see tests/shared_engines.py for the rules)
#
#     def test_x(shared_llm):                     @pytest.fixture(scope="module")
#         llm = shared_llm(runtime__threads=2)    def llm(shared_engines):
#                                                     with shared_engines.loans("test_y.llm") as borrow:
#                                                         yield borrow(runtime__threads=2)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def shared_engines() -> Iterator[SharedEngines]:
    """The session's engines by settings, lent through :meth:`SharedEngines.loans` (module fixtures use it)."""
    from shared_engines import SharedEngines, capacity_from_environment

    engines = SharedEngines(capacity_from_environment())
    yield engines
    engines.close()


@pytest.fixture
def shared_llm(shared_engines: SharedEngines, request: pytest.FixtureRequest) -> Iterator[Callable[..., object]]:
    """``shared_llm(**overrides)``: a ``patchbay.LLM`` of those settings.

    It is shared with every test that reads one alike.
    """
    with shared_engines.loans(request.node.nodeid) as borrow:
        yield borrow
