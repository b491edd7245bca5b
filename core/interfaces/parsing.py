"""Helpers shared by text parsers (tool calls, reasoning): partial markers and calls read from JSON."""

from __future__ import annotations

import json
from typing import Any

from patchbay.interfaces.tool_parser import ToolCall


def partial_marker_length(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker`` (0 when none could).

    A streaming parser holds these back until the next piece says whether
    the marker really begins there.
    """
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def tool_call_of(value: Any) -> ToolCall | None:
    """A call from a decoded ``{"name": ..., "arguments": {...}}`` object, else ``None``.

    ``parameters`` is accepted for ``arguments`` (Llama 3 writes it), and
    arguments given as the text of a JSON object are decoded.  Missing
    arguments mean ``{}``.  Anything else (no name, arguments that are not an
    object, both ``arguments`` and ``parameters``) is not a call; other keys are ignored.
    """
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    if "arguments" in value and "parameters" in value:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def decode_json(text: str) -> tuple[bool, Any]:
    """``(True, value)`` when ``text`` (surrounding whitespace aside) is one JSON value, else ``(False, None)``."""
    try:
        return True, json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return False, None
