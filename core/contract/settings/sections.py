"""What every settings section shares: unknown keys are errors, ``~`` paths expand, lists may be comma-separated,
a plugin is chosen by ``name`` with its ``options``, and renamed keys are read with a deprecation warning."""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ByteSize, ConfigDict, Field, TypeAdapter, ValidationError

DEFAULT_MODEL = "default"
"""The model path that means the bundled SmolLM2-135M-Instruct."""


def _expand_home(value: Any) -> Any:
    """``~/x`` and ``~user/x`` as the home directory's path (a path setting never means a directory named ``~``)."""
    if isinstance(value, Path):
        return value.expanduser()
    if isinstance(value, str) and value.startswith("~"):
        return str(Path(value).expanduser())
    return value


class Section(BaseModel):
    """Base of every settings section: unknown keys are errors; each field's docstring is its description
    (``patchbay serve --help`` shows it)."""

    model_config = ConfigDict(extra="forbid", validate_default=True, use_attribute_docstrings=True)


def _split_names(value: Any) -> Any:
    if isinstance(value, str) and value.lstrip().startswith("["):
        return json.loads(value)
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


_BYTE_SIZE = TypeAdapter(ByteSize)


def _byte_size_or_auto(value: Any) -> Any:
    """``auto``, or a byte size (``512MiB``, ``2GB``, a number of bytes) as its number of bytes."""
    if value == "auto":
        return value
    try:
        return int(_BYTE_SIZE.validate_python(value))
    except ValidationError as exc:
        raise ValueError(exc.errors()[0]["msg"]) from None


class PluginChoice(Section):
    """One plugin of a kind chosen by name, with its options: the shape of every plugin choice in settings (a
    plain string is short for ``{name: STRING}``)."""

    name: str
    """A registered plugin of the key's kind (``patchbay plugins --kind KIND`` lists them)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The plugin's options, validated against its ``Options`` model."""


def choice_shorthand(value: Any) -> Any:
    """``"torch"`` as ``{"name": "torch"}``: a plugin choice may be given by its name alone."""
    return {"name": value} if isinstance(value, str) else value


DEPRECATED_UNTIL = "0.2"
"""The release in which the renamed settings keys stop being read."""


def renamed_keys(data: Any, section: str, renames: Mapping[str, str], defaults: Mapping[str, Any] | None = None) -> Any:
    """``data`` (the raw mapping of ``section``, ``""`` for the top level) with each old key of ``renames`` moved
    to its new dotted key, with a :class:`FutureWarning` per key; an old key given beside its new one is an error.
    ``defaults`` gives the mapping a moved key lands in when its parent is absent (``{"kernel": {"name":
    "torch"}}``: ``kernel_options`` alone keeps the default kernel)."""
    if not isinstance(data, Mapping):
        return data
    moved = dict(data)
    for old, new in renames.items():
        if old not in moved:
            continue
        value = moved.pop(old)
        prefix = f"{section}." if section else ""
        warnings.warn(
            f"settings key {prefix}{old} is deprecated and read until patchbay {DEPRECATED_UNTIL}: use {prefix}{new}",
            FutureWarning,
            stacklevel=2,
        )
        *parents, last = new.split(".")
        target = moved
        for parent in parents:
            current = target.get(parent)
            current = choice_shorthand(current) if current is not None else dict((defaults or {}).get(parent, {}))
            if not isinstance(current, Mapping):
                return data  # let validation report the malformed section
            target[parent] = dict(current)
            target = target[parent]
        if last in target:
            raise ValueError(f"{old} (deprecated) and {new} both given; keep {new}")
        target[last] = value
    return moved
