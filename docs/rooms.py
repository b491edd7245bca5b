"""The architecture overview's room tree, generated from the source tree.

A room is a package of ``core/`` (import package ``patchbay``) or ``plugins/`` (``patchbay.plugins``);
its line is the first line of its ``__init__.py`` docstring, followed by its modules and any folder
of other sources (C++ under ``csrc/``). docs/generate_reference.py writes the table between the
``<!-- generated: rooms -->`` markers of docs/architecture.md, so the tree the docs show is the tree
there is.
"""

from __future__ import annotations

import ast
from pathlib import Path

from docsource import Linker, inline

REPO_ROOT = Path(__file__).resolve().parents[1]
TREES = {"core": "patchbay", "plugins": "patchbay.plugins"}
"""Each source folder and the import package it is."""


class RoomWithoutDocstring(Exception):
    """A package whose ``__init__.py`` has no docstring: its room would have no line."""


def first_line(path: Path) -> str:
    """The first line of a Python file's module docstring ('' when it has none)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def is_package(folder: Path) -> bool:
    return (folder / "__init__.py").is_file()


def skipped(path: Path) -> bool:
    return path.name.startswith((".", "__pycache__")) or path.name.endswith(".egg-info")


def source_files(folder: Path) -> str:
    """A non-package folder (``csrc/``) as its name and its files' names."""
    names = sorted(f.relative_to(folder).as_posix() for f in folder.rglob("*") if f.is_file() and not skipped(f.parent))
    return f"`{folder.name}/` ({', '.join(names)})"


def room_rows(folder: Path, package: str) -> list[str]:
    """The table row of the package in ``folder``, then those of its subpackages, depth first."""
    line = first_line(folder / "__init__.py")
    if not line:
        raise RoomWithoutDocstring(f"{folder / '__init__.py'} has no docstring; its first line is the room's "
                                   "line in docs/architecture.md")
    children = sorted(child for child in folder.iterdir() if not skipped(child))
    modules = [f"`{child.stem}`" for child in children
               if child.suffix == ".py" and child.name != "__init__.py"]
    others = [child for child in children if child.is_dir() and not is_package(child)]
    contents = modules + [source_files(other) for other in others]
    relative = folder.relative_to(REPO_ROOT).as_posix()
    rows = [f"| `{relative}/` | `{package}` | {inline(line, Linker()).replace('|', chr(92) + '|')} | {', '.join(contents) or '—'} |"]
    for child in children:
        if child.is_dir() and is_package(child):
            rows += room_rows(child, f"{package}.{child.name}")
    return rows


def room_blocks() -> dict[str, str]:
    """The ``rooms`` block of docs/architecture.md: one row per package of ``core/`` and ``plugins/``."""
    lines = ["| folder | package | what it holds | modules |", "|---|---|---|---|"]
    for folder, package in TREES.items():
        lines += room_rows(REPO_ROOT / folder, package)
    return {"rooms": "\n".join(lines) + "\n"}
