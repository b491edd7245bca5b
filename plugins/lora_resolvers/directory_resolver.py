"""``directory``: adapter ``NAME`` is the PEFT directory ``ROOT/NAME`` under one configured folder."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from patchbay.interfaces import LoRAResolveError, LoRAResolver, LoRAResolverCapabilities

CONFIG_FILE = "adapter_config.json"


class DirectoryOptions(BaseModel):
    """Options of ``lora: {resolver: directory, resolver_options: {...}}``."""

    model_config = ConfigDict(extra="forbid")

    root: Path | None = None
    """The folder whose subdirectories are adapters, each named by its directory name (required)."""


class DirectoryResolver(LoRAResolver):
    """Resolves adapter NAME to ROOT/NAME when that directory holds an adapter_config.json.

    Names are single path parts.
    """

    contract_version = "1.1"

    Options: ClassVar[type[BaseModel]] = DirectoryOptions
    options: DirectoryOptions  # an instance of Options, validated where the resolver is built
    capabilities: ClassVar[LoRAResolverCapabilities] = LoRAResolverCapabilities(can_list=True)

    def __init__(self, options: BaseModel | None = None) -> None:
        super().__init__(options)
        root = self.options.root
        if root is None:
            raise ValueError("lora_resolver:directory needs resolver_options.root, the folder of adapter directories")
        self.root = Path(root).expanduser().resolve()
        if not self.root.is_dir():
            raise ValueError(f"lora_resolver:directory: resolver_options.root {str(root)!r} is not a directory")

    def resolve(self, name: str) -> Path | None:
        if not _is_plain_name(name):
            return None
        candidate = self.root / name
        if not candidate.is_dir():
            return None
        if candidate.resolve().parent != self.root:  # a symbolic link out of the root
            raise LoRAResolveError(
                f"{candidate} links outside {self.root}; the directory resolver serves only adapters inside its root"
            )
        if not (candidate / CONFIG_FILE).is_file():
            raise LoRAResolveError(f"{candidate} has no {CONFIG_FILE}; it is not an adapter in PEFT's format")
        return candidate

    def available(self) -> list[str]:
        return sorted(
            entry.name
            for entry in self.root.iterdir()
            if _is_plain_name(entry.name) and (entry / CONFIG_FILE).is_file() and entry.resolve().parent == self.root
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
