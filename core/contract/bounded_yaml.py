"""YAML (and JSON) documents with bounded size, nesting and alias expansion.

PyYAML builds an alias as a second reference to one object, so a 1 KB
"billion laughs" document loads quickly into a graph whose *expanded* size is
billions of nodes; whatever walks it next (the settings' source tracking,
pydantic, ``yaml.safe_dump``) runs the machine out of memory.  Here a
document is measured as it would be expanded, with each shared object
counted once per reference (memoised, so the measuring is linear in the
graph), and refused past :data:`MAX_NODES` nodes, :data:`MAX_DEPTH` levels or
:data:`MAX_BYTES` of text; a self-referencing alias is refused as well.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_BYTES = 16 << 20
"""Largest settings document (inline prompts included)."""
MAX_NODES = 1_000_000
"""Most values in a document once its aliases are expanded."""
MAX_DEPTH = 64
"""Deepest nesting of mappings and lists."""


class DocumentTooLarge(ValueError):
    """A document over one of the bounds; the message says which, with the figures."""


def load_bounded(text: str) -> Any:
    """``yaml.safe_load(text)``, refused with :class:`DocumentTooLarge` past the bounds.

    Invalid YAML raises ``yaml.YAMLError`` as usual.
    """
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_BYTES:
        raise DocumentTooLarge(f"document of {size} bytes exceeds the limit of {MAX_BYTES} bytes")
    try:
        data = yaml.safe_load(text)
    except RecursionError:
        raise DocumentTooLarge(f"document nested too deeply (limit {MAX_DEPTH} levels)") from None
    check_bounds(data)
    return data


def check_bounds(data: Any) -> None:
    """Raise :class:`DocumentTooLarge` if ``data`` expanded has over :data:`MAX_NODES` values or
    :data:`MAX_DEPTH` levels, or contains itself."""
    sizes: dict[int, int] = {}
    in_progress: set[int] = set()

    def expanded(value: Any, depth: int) -> int:
        if not isinstance(value, (dict, list)):
            return 1
        key = id(value)
        if key in sizes:
            return sizes[key]
        if depth > MAX_DEPTH:
            raise DocumentTooLarge(f"document nested more than {MAX_DEPTH} levels deep")
        if key in in_progress:
            raise DocumentTooLarge("document contains itself (a recursive alias)")
        in_progress.add(key)
        children = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        total = 1
        for child in children:
            total += expanded(child, depth + 1)
            if total > MAX_NODES:
                raise DocumentTooLarge(
                    f"document expands to more than {MAX_NODES} values (aliases repeat their anchor's contents)"
                )
        in_progress.discard(key)
        sizes[key] = total
        return total

    expanded(data, 0)
