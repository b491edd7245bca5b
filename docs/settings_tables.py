"""The configuration guide's key tables, generated from the settings models and the built-in plugins' options.

One source: the docstring under each field of ``patchbay.contract.settings`` (and of each built-in
plugin's ``Options`` model) is the key's "what it does" cell; the values and the default come from the
field's type and default. A docstring may point at a longer explanation as ``docs/PAGE.md#anchor``;
the cell links it. docs/generate_reference.py writes each section's block between
``<!-- generated: settings.SECTION -->`` markers of docs/configuration.md.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import textwrap
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, BeforeValidator, ByteSize, PlainValidator, SecretStr, WrapValidator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from docsource import Linker, docstring_after, inline

DOCS_DIR = Path(__file__).resolve().parent

VALUES_OF_VALIDATOR = {
    "_byte_size_or_auto": "byte size or `auto`",
    "choice_shorthand": "`{name, options}` or a plugin name",
}
"""Fields whose accepted values a before-validator widens: what they accept, by the validator's name."""

VALUES_OF_TYPE: dict[Any, str] = {ByteSize: "byte size", SecretStr: "secret string", Path: "path", str: "string"}
"""Types that read as one noun."""

DOC_LINK = re.compile(r"docs/([\w./-]+\.md)(?:#([\w-]+))?")


class UndocumentedKey(Exception):
    """A settings key or plugin option without a docstring: its table row would say nothing."""


# -- values and defaults ---------------------------------------------------------------------------------


def _bounds(metadata: list[Any]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for item in metadata:
        for bound in (Gt, Ge, Lt, Le):
            if isinstance(item, bound):
                found[bound.__name__.lower()] = getattr(item, bound.__name__.lower())
        if isinstance(item, FieldInfo):
            found |= _bounds(item.metadata)
    return found


def _number(noun: str, metadata: list[Any]) -> str:
    bounds = _bounds(metadata)
    low = ("(", bounds["gt"]) if "gt" in bounds else ("[", bounds["ge"]) if "ge" in bounds else None
    high = (")", bounds["lt"]) if "lt" in bounds else ("]", bounds["le"]) if "le" in bounds else None
    if low == ("(", 0) and high is None:
        return f"positive {noun}"
    if low is not None and high is not None:
        if noun == "integer" and low[0] == "[" and high[0] == "]":
            return f"integer {low[1]}–{high[1]}"
        return f"{noun} in {low[0]}{low[1]}, {high[1]}{high[0]}"
    if low is not None:
        return f"{noun} {'>' if low[0] == '(' else '≥'} {low[1]}"
    if high is not None:
        return f"{noun} {'<' if high[0] == ')' else '≤'} {high[1]}"
    return noun


def _plural(text: str) -> str:
    """Each alternative of ``text`` in the plural: ``positive integers``, ``integers 1–65535``, ``strings``."""

    def plural(part: str) -> str:
        if part.startswith("`"):
            return part
        words = part.split(" ")
        nouns = [index for index, word in enumerate(words) if word in ("integer", "number")]
        index = nouns[0] if nouns else len(words) - 1
        words[index] += "s"
        return " ".join(words)

    return " or ".join(plural(part) for part in text.split(" or "))


def describe_values(annotation: Any, metadata: Sequence[Any] = ()) -> str:
    """The values a field accepts, in words: ``positive integer or null``, ```auto`, `cpu```..."""
    for item in metadata:
        if isinstance(item, (BeforeValidator, PlainValidator, WrapValidator)):
            name = getattr(item.func, "__name__", repr(item.func))
            if name not in VALUES_OF_VALIDATOR:
                raise UndocumentedKey(
                    f"a field's values are widened by the validator {name!r}; say what it "
                    "accepts in VALUES_OF_VALIDATOR of docs/settings_tables.py"
                )
            return VALUES_OF_VALIDATOR[name]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return describe_values(args[0], [*metadata, *args[1:]])
    if origin in (typing.Union, types.UnionType):
        parts = [describe_values(arg, metadata) for arg in args if arg is not type(None)]
        text = " or ".join(parts)
        return f"{text} or null" if type(None) in args else text
    if origin is typing.Literal:
        return ", ".join(f"`{value}`" for value in args)
    if origin is list:
        return f"list of {_plural(describe_values(args[0]))}" if args else "list"
    if origin is dict or annotation is dict:
        return "mapping"
    if annotation is bool:
        return "boolean"
    if annotation is int:
        return _number("integer", metadata)
    if annotation is float:
        return _number("number", metadata)
    if annotation in VALUES_OF_TYPE:
        return VALUES_OF_TYPE[annotation]
    return getattr(annotation, "__name__", str(annotation))


def describe_default(info: FieldInfo) -> str:
    """The default as a YAML reader writes it (`null`, `true`, `{}`), or ``(required)``."""
    if info.is_required():
        return "(required)"
    value = info.default_factory() if info.default_factory is not None else info.default  # type: ignore[call-arg]
    if value is PydanticUndefined:
        return "(required)"
    if isinstance(value, ByteSize):
        value = value.human_readable()
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    return f"`{value}`" if isinstance(value, str) else f"`{json.dumps(value)}`"


# -- cells -----------------------------------------------------------------------------------------------


def doc_markdown(doc: str, page: Path) -> str:
    """A docstring as one Markdown line of ``page``: inline code, ``docs/…`` pointers as links."""
    text = inline(" ".join(doc.split()), Linker())

    def link(match: re.Match[str]) -> str:
        target, anchor = DOCS_DIR / match.group(1), match.group(2)
        relative = "" if target == page else os.path.relpath(target, page.parent)
        label = anchor.replace("-", " ") if anchor else target.stem.replace("-", " ")
        return f"[{label}]({relative}{'#' + anchor if anchor else ''})"

    return DOC_LINK.sub(link, text)


def doc_cell(doc: str, page: Path) -> str:
    """A docstring as one table cell of ``page``."""
    return doc_markdown(doc, page).replace("|", "\\|")


def field_docs(model: type[BaseModel]) -> dict[str, str]:
    """The docstring under each field of ``model`` (inherited fields included), by field name."""
    docs: dict[str, str] = {}
    for klass in reversed(model.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, BaseModel)) or klass is BaseModel:
            continue
        node = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0]
        assert isinstance(node, ast.ClassDef)
        for index, statement in enumerate(node.body):
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                docs[statement.target.id] = docstring_after(node.body, index)
    return docs


def rows(model: type[BaseModel], page: Path, first_columns: Callable[[str], list[str]]) -> list[str]:
    """One table row per field of ``model``; a field without a docstring is an error naming it."""
    docs = field_docs(model)
    lines = []
    for name, info in model.model_fields.items():
        doc = docs.get(name, "")
        if not doc:
            raise UndocumentedKey(
                f"{model.__module__}.{model.__qualname__}.{name} has no docstring; "
                "the configuration guide's row is made of it"
            )
        values = describe_values(info.annotation, info.metadata)
        cells = [*first_columns(name), values, describe_default(info), doc_cell(doc, page)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


# -- blocks ----------------------------------------------------------------------------------------------


def builtin_options(kind: str, role: str | None = None) -> list[tuple[str, type[BaseModel]]]:
    """``(name, Options model)`` of each built-in plugin of ``kind`` (distribution ``patchbay``) with options; of
    those whose capabilities say ``role``, when given (samplers)."""
    from importlib import metadata

    from patchbay.contract.registry import ENTRY_POINT_GROUP, Registry

    builtin = [
        entry
        for entry in metadata.entry_points(group=ENTRY_POINT_GROUP)
        if entry.dist is not None and entry.dist.name == "patchbay"
    ]
    registry = Registry.from_entry_points(strict=True, entry_points=builtin)
    found = []
    for registration in registry.registrations(kind):
        implementation = registration.resolve()
        if role is not None and getattr(implementation.capabilities, "role", None) != role:
            continue
        if implementation.Options.model_fields:
            found.append((registration.name, implementation.Options))
    return found


def section_block(section: str, page: Path) -> str:
    """The heading, introduction and table of one settings section, and its built-in plugins' options."""
    from patchbay.contract.settings import Section, Settings

    info = Settings.model_fields[section]
    model = next(
        arg
        for arg in (info.annotation, *typing.get_args(info.annotation))
        if isinstance(arg, type) and issubclass(arg, Section)
    )
    lines = [f"### `{section}`", ""]
    doc = inspect.cleandoc(model.__doc__ or "")
    if doc:
        lines += [doc_markdown(doc, page), ""]
    if info.default is None:
        required = [f"`{name}`" for name, field in model.model_fields.items() if field.is_required()]
        if required:
            lines += [
                f"Absent by default; when present, {' and '.join(required)} "
                f"{'is' if len(required) == 1 else 'are'} required.",
                "",
            ]
        else:
            lines += ["Absent by default: the feature is off until the section is given.", ""]
    lines += ["| key | values | default | what it does |", "|---|---|---|---|"]
    lines += rows(model, page, lambda name: [f"`{name}`"])
    from patchbay.contract.kinds import KINDS

    for kind in KINDS.values():
        for site in kind.choices:
            plugins = builtin_options(kind.name, site.role) if site.path[0] == section else []
            if not plugins:
                continue
            lines += [
                "",
                f"Options of the built-in plugins (`{site.dotted}.options`):",
                "",
                "| option | plugin | values | default | what it does |",
                "|---|---|---|---|---|",
            ]
            for name, options in plugins:
                lines += rows(options, page, lambda option, plugin=name: [f"`{option}`", f"`{plugin}`"])
    return "\n".join(lines) + "\n"


def settings_blocks(page: Path) -> dict[str, str]:
    """Every section's block of ``page``, by marker name (``settings.model``, ...)."""
    from patchbay.contract.settings import Settings

    return {f"settings.{section}": section_block(section, page) for section in Settings.model_fields}
