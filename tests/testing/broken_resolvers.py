"""LoRA resolvers, each the built-in ``directory`` resolver broken on purpose in one way the kit of contract 1.1
let through, each of which serves the wrong files in a real run (``test_kit_catches.py`` runs the kit on each)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from patchbay.interfaces import LoRAResolveError
from patchbay.plugins.lora_resolvers.directory_resolver import CONFIG_FILE, DirectoryResolver


class FollowsFileLinks(DirectoryResolver):
    """Broken: checks that the adapter's folder stays in the root, not its files (issue 57, item 4)."""

    def resolve(self, name: str, *, base_model: str | None = None) -> Path | None:
        if not name or "/" in name or name in (".", ".."):
            return None
        candidate = self.root / name
        if not candidate.is_dir():
            return None
        if candidate.resolve().parent != self.root:
            raise LoRAResolveError(f"{candidate} links outside {self.root}")
        if not (candidate / CONFIG_FILE).is_file():
            raise LoRAResolveError(f"{candidate} has no {CONFIG_FILE}")
        return candidate


class PrefixContainment(DirectoryResolver):
    """Broken: "inside the root" is ``str(path).startswith(str(root))``, true of ``/root-evil`` too."""

    def resolve(self, name: str, *, base_model: str | None = None) -> Path | None:
        found = (self.root / name).resolve()
        if not str(found).startswith(str(self.root)) or not found.exists():
            return None
        if not (found / CONFIG_FILE).is_file():
            raise LoRAResolveError(f"{found} has no {CONFIG_FILE}")
        return found


class RemembersMisses(DirectoryResolver):
    """Broken: a name once unknown stays unknown (an adapter added later is never found)."""

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._misses: set[str] = set()

    def resolve(self, name: str, *, base_model: str | None = None) -> Path | None:
        if name in self._misses:
            return None
        found = super().resolve(name, base_model=base_model)
        if found is None:
            self._misses.add(name)
        return found


class KeepsPrivateCopy(DirectoryResolver):
    """Broken: copies an adapter on first use and serves the copy ever after (stale weights once replaced)."""

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._copies: dict[str, Path] = {}
        self._store = Path(tempfile.mkdtemp(prefix="kept-adapters-"))

    def resolve(self, name: str, *, base_model: str | None = None) -> Path | None:
        if name in self._copies:
            return self._copies[name]
        found = super().resolve(name, base_model=base_model)
        if found is None:
            return None
        copy = self._store / name
        shutil.copytree(found, copy)
        self._copies[name] = copy
        return copy


class IgnoresTheBaseModel(DirectoryResolver):
    """Broken: takes ``base_model`` but never compares it, though it declares ``checks_base_model``."""

    def resolve(self, name: str, *, base_model: str | None = None) -> Path | None:
        return super().resolve(name)
