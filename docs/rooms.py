"""The architecture overview's room tree and the module index, generated from the source tree.

A room is a package of ``core/`` (import package ``patchbay``) or ``plugins/`` (``patchbay.plugins``);
its line is the first line of its ``__init__.py`` docstring, followed by its modules and any folder
of other sources (C++ under ``csrc/``). docs/generate_reference.py writes the table between the
``<!-- generated: rooms -->`` markers of docs/architecture.md, and docs/design/modules.md whole (each
module with its docstring's first line), so the tree the docs show is the tree there is.
"""

from __future__ import annotations

import ast
from pathlib import Path

from docsource import Linker, inline
from layering import PLUGIN_RULE, RULES, room_imports

REPO_ROOT = Path(__file__).resolve().parents[1]
TREES = {"core": "patchbay", "plugins": "patchbay.plugins"}
"""Each source folder and the import package it is."""


class MissingDocstring(Exception):
    """A package or module without a docstring: its line in the docs would be empty."""


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
    names = sorted(
        path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file() and not skipped(path.parent)
    )
    return f"`{folder.name}/` ({', '.join(names)})"


def room_rows(folder: Path, package: str) -> list[str]:
    """The table row of the package in ``folder``, then those of its subpackages, depth first."""
    line = first_line(folder / "__init__.py")
    if not line:
        raise MissingDocstring(
            f"{folder / '__init__.py'} has no docstring; its first line is the room's line in docs/architecture.md"
        )
    children = sorted(child for child in folder.iterdir() if not skipped(child))
    relative = folder.relative_to(REPO_ROOT).as_posix()
    described = inline(line, Linker()).replace("|", "\\|")
    modules_here = [child for child in children if child.suffix == ".py"]
    tree = relative.split("/")[0]
    imported = [
        f"`{room.removeprefix('patchbay.')}`"
        for room in room_imports(modules_here, REPO_ROOT / tree, TREES[tree], package)
    ]
    rows = [f"| `{relative}/` | `{package}` | {described} | {', '.join(imported) or '—'} |"]
    for child in children:
        if child.is_dir() and is_package(child):
            rows += room_rows(child, f"{package}.{child.name}")
    return rows


def room_blocks() -> tuple[dict[str, str], dict[str, str]]:
    """The ``rooms`` block of docs/architecture.md (one row per package of ``core/`` and ``plugins/``) and the
    ``layering`` block of docs/design/layering.md (one row per rule)."""
    lines = [
        "| folder | package | what it holds | imports (of `patchbay`) |",
        "|---|---|---|---|",
    ]
    for folder, package in TREES.items():
        lines += room_rows(REPO_ROOT / folder, package)
    rules = ["| rule | says |", "|---|---|", *(f"| `{rule.name}` | {rule.says} |" for rule in RULES)]
    rules.append(
        f"| `{PLUGIN_RULE}` | a plugin (under `plugins/`) imports only public names: `patchbay.__all__`, the "
        "interfaces, the contract, the toolkit's `__all__` and its own package |"
    )
    return {"rooms": "\n".join(lines) + "\n"}, {"layering": "\n".join(rules) + "\n"}


def readme_layout() -> dict[str, str]:
    """The README's ``layout`` block: each room of ``core/`` and each folder of ``plugins/`` with its line."""
    width = 26
    lines = ["```"]
    for folder in TREES:
        root = REPO_ROOT / folder
        lines.append(f"{folder + '/':<{width}}{first_line(root / '__init__.py')}")
        for child in sorted(child for child in root.iterdir() if child.is_dir() and is_package(child)):
            lines.append(f"  {child.name + '/':<{width - 2}}{first_line(child / '__init__.py')}")
    lines += [
        f"{'tests/':<{width}}tests in folders that mirror the rooms; tests/support (helpers), tests/distributions"
    ]
    lines += [f"{'docs/':<{width}}guides, the plugin reference, design notes; generators of the generated pages", "```"]
    return {"layout": "\n".join(lines) + "\n"}


def packages() -> list[tuple[Path, str]]:
    """``(folder, import name)`` of every package of the trees, depth first."""
    found: list[tuple[Path, str]] = []

    def walk(folder: Path, package: str) -> None:
        found.append((folder, package))
        for child in sorted(folder.iterdir()):
            if child.is_dir() and is_package(child) and not skipped(child):
                walk(child, f"{package}.{child.name}")

    for folder, package in TREES.items():
        walk(REPO_ROOT / folder, package)
    return found


def module_index() -> str:
    """docs/design/modules.md: every module of every room with the first line of its docstring."""
    lines = [
        "# Every module, room by room",
        "",
        "<!-- Generated by docs/generate_reference.py from the source tree. Do not edit by hand: run",
        "     `python docs/generate_reference.py` (tests/project/test_docs.py fails when this file is stale). -->",
        "",
        "Each line is the first line of the module's docstring. The rooms are introduced in",
        "[the architecture overview](../architecture.md#the-rooms).",
    ]
    for folder, package in packages():
        relative = folder.relative_to(REPO_ROOT).as_posix()
        room_line = inline(first_line(folder / "__init__.py"), Linker())
        lines += ["", f"## `{relative}/`", "", f"`{package}`: {room_line}", ""]
        children = sorted(child for child in folder.iterdir() if not skipped(child))
        modules = [child for child in children if child.suffix == ".py" and child.name != "__init__.py"]
        others = [child for child in children if child.is_dir() and not is_package(child)]
        if not modules and not others:
            continue
        lines += ["| module | what it holds |", "|---|---|"]
        for module in modules:
            line = first_line(module)
            if not line:
                raise MissingDocstring(
                    f"{module} has no docstring; its first line is its entry in docs/design/modules.md"
                )
            lines.append(f"| `{module.name}` | {inline(line, Linker()).replace('|', chr(92) + '|')} |")
        for other in others:
            lines.append(f"| {source_files(other)} | sources other than Python |")
    return "\n".join(lines) + "\n"
