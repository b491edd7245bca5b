"""patchbay's cache folder: built kernels, converted models, CPU tunings, and whatever a plugin keeps there."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_DIR_VARIABLE", "cache_dir"]

CACHE_DIR_VARIABLE = "PATCHBAY_CACHE_DIR"
"""The environment variable that moves the cache folder."""


def cache_dir() -> Path:
    """The cache folder: ``$PATCHBAY_CACHE_DIR`` or ``~/.cache/patchbay`` (not created here).  A plugin keeps its
    files in a sub-folder named after itself."""
    root = os.environ.get(CACHE_DIR_VARIABLE) or Path.home() / ".cache" / "patchbay"
    return Path(root)
