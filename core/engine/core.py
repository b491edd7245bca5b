"""Deprecated alias of the engine's old home: import from :mod:`patchbay.engine` instead.

``Engine`` and ``KVConnectorStalledError`` moved to :mod:`patchbay.engine.engine`,
``measure_machine_defaults`` and the settings' resolution (device, dtype, tuning) to
:mod:`patchbay.engine.builder`, ``EngineStats`` to :mod:`patchbay.engine.report`.
This module goes away in a later release (docs/plugin-guide.md, "Deprecated names").
"""

from __future__ import annotations

import warnings

from patchbay.engine.builder import (
    machine_tuning,
    measure_machine_defaults,
    ranks_on_this_machine,
    resolve_device,
    resolve_dtype,
    single_thread_max_tokens,
)
from patchbay.engine.engine import Engine, KVConnectorStalledError
from patchbay.engine.report import EngineStats

__all__ = [
    "Engine",
    "EngineStats",
    "KVConnectorStalledError",
    "machine_tuning",
    "measure_machine_defaults",
    "ranks_on_this_machine",
    "resolve_device",
    "resolve_dtype",
    "single_thread_max_tokens",
]

warnings.warn(
    "patchbay.engine.core is deprecated: import Engine and the other names from patchbay.engine",
    DeprecationWarning,
    stacklevel=2,
)
