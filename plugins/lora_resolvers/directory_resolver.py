"""``directory``: adapter ``NAME`` is the PEFT directory ``ROOT/NAME`` under one configured folder."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from patchbay.interfaces import LoRAResolveError, LoRAResolver, LoRAResolverCapabilities

CONFIG_FILE = "adapter_config.json"
BASE_MODEL_KEY = "base_model_name_or_path"


class DirectoryOptions(BaseModel):
    """Options of ``lora: {resolver: {name: directory, options: {...}}}``."""

    model_config = ConfigDict(extra="forbid")

    root: Path | None = None
    """The folder whose subdirectories are adapters, each named by its directory name (required)."""
    check_base_model: bool = True
    """Refuse an adapter whose ``adapter_config.json`` names another base model than the run's (names compared
    by their last path part, case-insensitive, a ``.gguf`` suffix dropped); false serves it anyway."""


class DirectoryResolver(LoRAResolver):
    """Resolves adapter NAME to ROOT/NAME when that directory holds an adapter_config.json.

    Names are single path parts.  The directory and every file in it must
    stay inside the root once symbolic links are followed; the folder is
    read afresh on every call, so adapters added or replaced are seen at once.
    """

    contract_version = "1.2"

    Options: ClassVar[type[BaseModel]] = DirectoryOptions
    options: DirectoryOptions  # an instance of Options, validated where the resolver is built
    capabilities: ClassVar[LoRAResolverCapabilities] = LoRAResolverCapabilities(can_list=True, checks_base_model=True)

    def __init__(self, options: BaseModel | None = None) -> None:
        super().__init__(options)
        root = self.options.root
        if root is None:
            raise ValueError(
                "lora_resolver:directory needs lora.resolver.options.root, the folder of adapter directories"
            )
        self.root = Path(root).expanduser().resolve()
        if not self.root.is_dir():
            raise ValueError(f"lora_resolver:directory: lora.resolver.options.root {str(root)!r} is not a directory")

    def resolve(self, name: str, *, base_model: str | None = None) -> Path | None:
        if not _is_plain_name(name):
            return None
        candidate = self.root / name
        if not candidate.is_dir():
            return None
        if candidate.resolve().parent != self.root:  # a symbolic link out of the root
            raise LoRAResolveError(
                f"{candidate} links outside {self.root}; the directory resolver serves only adapters inside its root"
            )
        escaping = _first_link_out(candidate, self.root)
        if escaping is not None:
            raise LoRAResolveError(
                f"{escaping} links outside {self.root}; the directory resolver serves only files inside its root"
            )
        if not (candidate / CONFIG_FILE).is_file():
            raise LoRAResolveError(f"{candidate} has no {CONFIG_FILE}; it is not an adapter in PEFT's format")
        if base_model is not None and self.options.check_base_model:
            _check_base_model(candidate, base_model)
        return candidate

    def available(self) -> list[str]:
        return sorted(
            entry.name
            for entry in self.root.iterdir()
            if _is_plain_name(entry.name)
            and (entry / CONFIG_FILE).is_file()
            and entry.resolve().parent == self.root
            and _first_link_out(entry, self.root) is None
        )


def _is_plain_name(name: str) -> bool:
    return (
        bool(name)
        and name not in (".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and not name.startswith(".")
    )


def _first_link_out(directory: Path, root: Path) -> Path | None:
    """The first entry under ``directory`` (its own files and folders, at any depth) whose target, every link
    followed, lies outside ``root``; ``None`` when all stay inside.  Folders are walked without following links,
    so a link is judged by where it points, never entered."""
    for folder, folders, files in os.walk(directory):
        for entry in (*folders, *files):
            path = Path(folder) / entry
            if not path.resolve().is_relative_to(root):
                return path
    return None


def _check_base_model(adapter: Path, base_model: str) -> None:
    """Raise :class:`LoRAResolveError` when the adapter's config names a base model other than ``base_model``."""
    try:
        config = json.loads((adapter / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAResolveError(f"{adapter / CONFIG_FILE} cannot be read as JSON: {exc}") from None
    trained_on = config.get(BASE_MODEL_KEY) if isinstance(config, dict) else None
    if not isinstance(trained_on, str) or not trained_on.strip():
        return  # the adapter does not say: nothing to compare
    if _model_name(trained_on) != _model_name(base_model):
        raise LoRAResolveError(
            f"{adapter} is an adapter for base model {trained_on!r} ({CONFIG_FILE} {BASE_MODEL_KEY}), but this run "
            f"serves {base_model!r}; set lora.resolver.options.check_base_model: false to serve it anyway"
        )


def _model_name(reference: str) -> str:
    """``"org/Model-7B"``, ``"/models/model-7b/"`` and ``"model-7b.gguf"`` all give ``"model-7b"``."""
    last = re.split(r"[\\/]", reference.strip().rstrip("/\\"))[-1]
    return last.lower().removesuffix(".gguf")
