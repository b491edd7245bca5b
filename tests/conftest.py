"""Shared fixtures of the patchbay test suite.

Each group below is self-contained; add new groups rather than growing one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from repo_paths import DISTRIBUTIONS
from processes import pip_install_into, run_patchbay

if TYPE_CHECKING:
    from shared_engines import SharedEngines


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
# tests/distributions/{example,broken,duplicate}_plugin are real distributions with
# their own pyproject.toml.  `plugin_site` pip-installs them into a temporary directory (never into
# the venv); a process started with PYTHONPATH=<site> sees their `patchbay` entry points exactly
# as it would after `pip install patchbay-example-plugin`.
# ------------------------------------------------------------------------------------------------

PLUGIN_PACKAGES = tuple(DISTRIBUTIONS / name for name in ("example_plugin", "broken_plugin", "duplicate_plugin"))
DENY_BROKEN_AND_DUPLICATE = "patchbay-broken-plugin,patchbay-duplicate-plugin"
"""PATCHBAY_PLUGINS__DENY value that leaves the built-ins and the example plugin: a clean registry."""


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
    from patchbay.toolkit.paths import cache_dir

    shared = cache_dir()
    own = tmp_path / "cache"
    own.mkdir()
    for folder in ("kernels", "tuning"):
        (shared / folder).mkdir(parents=True, exist_ok=True)
        (own / folder).symlink_to(shared / folder, target_is_directory=True)
    monkeypatch.setenv("PATCHBAY_CACHE_DIR", str(own))
    return own


# ------------------------------------------------------------------------------------------------
# Tiny random-weight models (see tests/support/tiny_models.py)
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
# Engines shared by the tests that only read them (see tests/support/shared_engines.py for the rules)
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


# In-process engines on a GGUF file run its float conversion under `model.weight_format: auto` (the cached
# safetensors copy transformers' GGUF reader makes, `toolkit.model_files.resolve_model_dir`): the suite compares
# the engine's machinery (batching, chunking, preemption, drafters, caches) token for token, and a GGUF file's
# own blocks round activations to int8 per row, so their greedy tokens may flip at near-ties as rows group
# differently. The blocks run wherever a test names the gguf format (tests/plugins/weight_formats) and in every
# subprocess (make run, patchbay serve).
@pytest.fixture(scope="session", autouse=True)
def _gguf_as_floats_under_auto() -> Iterator[None]:
    from patchbay.engine import builder
    from patchbay.toolkit.model_files import resolve_model_dir
    from patchbay.worker.model import checkpoints

    resolve = checkpoints.resolve_model

    def floats_for_gguf(path, choice, registry, config):  # type: ignore[no-untyped-def]
        resolved = resolve(path, choice, registry, config)
        if choice.name != "auto" or resolved.weight_format_name != "gguf":
            return resolved
        directory = resolve_model_dir(path)
        return checkpoints.ResolvedModel(checkpoints.checkpoint_of(str(directory)), directory, None, None)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoints, "resolve_model", floats_for_gguf)
        patch.setattr(builder, "resolve_model", floats_for_gguf)
        yield
