"""patchbay: an LLM inference runner in which every moving part is a plugin.

Plugin authors need :data:`hookimpl` and :mod:`patchbay.interfaces`;
embedders use :class:`patchbay.LLM` (offline) or :class:`patchbay.AsyncLLM`
(asyncio, streaming) and :class:`patchbay.SamplingParams`.

The package is laid out in rooms that follow a request's path (docs/architecture.md):
``entrypoints`` (LLM, CLI, run, serve) -> ``engine`` -> ``scheduling`` (device-free) ->
``worker`` (tensors) -> the plugins, whose contract is ``interfaces`` and ``contract``;
``testing`` is the conformance kit and ``bench`` the benchmark harness.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

# OpenMP's default busy-waiting makes each of torch's threads spin between parallel regions; on a
# machine with a busy neighbour that turns a 50 ms decode step into 500 ms.  Passive waiting costs
# nothing measurable when the machine is quiet.  It only takes effect if torch is not imported yet,
# and an explicit OMP_WAIT_POLICY always wins.
OMP_POLICY_TOO_LATE = "torch" in sys.modules and "OMP_WAIT_POLICY" not in os.environ
"""torch was imported before patchbay with no wait policy set: the engine warns that steps may crawl."""
OMP_POLICY_SET_HERE = "OMP_WAIT_POLICY" not in os.environ
"""patchbay set the wait policy (the user had not): processes it starts for other engines leave it out."""
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Imported after the policy is set, so nothing they import can load torch before it.
from patchbay.contract.hookspecs import hookimpl  # noqa: E402
from patchbay.sampling_params import SamplingParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["AsyncLLM", "LLM", "SamplingParams", "hookimpl", "__version__"]

if TYPE_CHECKING:
    from patchbay.engine.async_llm import AsyncLLM
    from patchbay.entrypoints.llm import LLM


def __getattr__(name: str) -> Any:
    # The offline API pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from patchbay.entrypoints.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from patchbay.engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module 'patchbay' has no attribute {name!r}")
