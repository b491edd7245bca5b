"""patchbay's built-in plugins, registered through the ``patchbay`` entry-point group like any other.

Each folder is named after the plugin kind it holds (``drafters`` hold
``drafter`` plugins).  A folder's old name still imports, as a deprecated
alias of the same modules (docs/plugin-guide.md, "Deprecated names").
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

RENAMED_PACKAGES = {"patchbay.plugins.spec_decode": "patchbay.plugins.drafters"}
"""Old package name -> new one: importing the old name (or a module below it) gives the new module."""


class _RenamedPackageFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a module under a renamed package as the very module of the new name (one module object, one class)."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}
        """The new modules' own specs by alias, between ``create_module`` and ``exec_module``."""

    def find_spec(
        self, fullname: str, path: object = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        for old in RENAMED_PACKAGES:
            if fullname == old or fullname.startswith(old + "."):
                return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname == old)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        old = next(old for old in RENAMED_PACKAGES if spec.name == old or spec.name.startswith(old + "."))
        new_name = RENAMED_PACKAGES[old] + spec.name[len(old) :]
        warnings.warn(f"{spec.name} is deprecated: import {new_name}", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new_name)
        self._specs[spec.name] = module.__spec__  # the import system overwrites it: exec_module puts it back
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        for alias, original in list(self._specs.items()):
            if original is not None and original.name == module.__name__:
                module.__spec__ = original
                del self._specs[alias]


if not any(isinstance(finder, _RenamedPackageFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RenamedPackageFinder())  # before the path finders, which would load a second copy
