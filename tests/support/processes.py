"""Processes the tests start: pip installs into a private folder, and the ``patchbay`` command line with them."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path


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
