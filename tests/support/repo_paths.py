"""Where the repository, the test folder and the test distributions are, for tests in any folder."""

from __future__ import annotations

from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[1]
"""``tests/``."""
REPO_ROOT = TESTS_DIR.parent
"""The repository's root (``pyproject.toml``, ``core/``, ``plugins/``, ``docs/``)."""
DISTRIBUTIONS = TESTS_DIR / "distributions"
"""Third-party plugin distributions (each with its own ``pyproject.toml``) the tests install."""
