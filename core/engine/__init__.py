"""The engine joins the scheduler, the worker and the plugins, and turns each step into request outputs.

The names below are its public API, the only way the entry points reach it;
they import lazily so that ``patchbay --help`` does not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from patchbay.engine.core import Engine, measure_machine_defaults
    from patchbay.engine.outputs import Completion, RequestMetrics, RequestOutput
    from patchbay.worker.model_loader import ModelLoadError

__all__ = ["Completion", "Engine", "ModelLoadError", "RequestMetrics", "RequestOutput", "measure_machine_defaults"]
_MODULE_OF = {"Engine": "patchbay.engine.core", "ModelLoadError": "patchbay.worker.model_loader",
              "measure_machine_defaults": "patchbay.engine.core"}
"""Where each public name lives when it is not in :mod:`patchbay.engine.outputs`."""


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'patchbay.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF.get(name, "patchbay.engine.outputs")), name)
