"""patchbay: an LLM inference runner in which every moving part is a plugin.

Plugin authors need :data:`hookimpl` and :mod:`patchbay.interfaces`;
embedders use :class:`patchbay.LLM`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from patchbay.hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["LLM", "hookimpl", "__version__"]

if TYPE_CHECKING:
    from patchbay.llm import LLM


def __getattr__(name: str) -> Any:
    # The offline API pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from patchbay.llm import LLM

        return LLM
    raise AttributeError(f"module 'patchbay' has no attribute {name!r}")
