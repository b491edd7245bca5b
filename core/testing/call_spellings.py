"""How models spell tool calls: calls found in a parser's own ``render`` and written again as models write them.

A parser's ``render`` writes calls one way; models write the same calls in
many: JSON with ``\\uXXXX`` escapes or without, compact or indented, keys in
another order, ``\\/`` for ``/``, arguments given as the text of a JSON object;
Python calls with either quote, escapes, spaces around ``=``, a trailing
comma, floats with exponents.  :func:`respell` finds the calls in a rendered
text (JSON values holding their arguments, or ``name(key=value, ...)``
expressions) and writes them again in one :data:`JSON_SPELLINGS` or
:data:`PYTHON_SPELLINGS` spelling, leaving the rest of the text, the
format's own markup, as it was.  Every spelling says the same calls.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from typing import Any

from patchbay.interfaces import ToolCall

JSON_SPELLINGS = ("ascii_escapes", "compact", "indented", "escaped_slashes", "keys_reordered", "string_arguments")
"""Ways a model writes one JSON value (``string_arguments``: each call's arguments as the text of its object)."""
PYTHON_SPELLINGS = ("single_quotes", "ascii_escapes", "spaced", "trailing_comma", "exponent_floats")
"""Ways a model writes a Python call of literals."""


class CallsNotFound(ValueError):
    """A rendered text in which the calls it was rendered from cannot be found in the declared syntax."""


def respell(text: str, calls: Sequence[ToolCall], syntax: str, spelling: str) -> str | None:
    """``text`` (rendered from ``calls``) with every call written in ``spelling`` of ``syntax`` (``json`` or
    ``python``); ``None`` when the spelling does not apply to this format (``string_arguments`` where the
    arguments are not a value next to the call's name).  Raises :class:`CallsNotFound`."""
    wanted = [json.loads(call.arguments) for call in calls]
    if syntax == "json":
        return _respell_json(text, calls, wanted, spelling)
    if syntax == "python":
        return _respell_python(text, calls, wanted, spelling)
    raise ValueError(f"no spellings for arguments_syntax {syntax!r}")


# -- JSON -----------------------------------------------------------------------------------------------


def json_spans(text: str, calls: Sequence[ToolCall]) -> list[tuple[int, int, Any]]:
    """``(start, end, value)`` of the JSON values in ``text`` that hold the calls' arguments, in order.

    A value holds a call when some object in it is the call's arguments
    (preferably an object that also names the call).  Raises
    :class:`CallsNotFound` when a call's arguments are in no value.
    """
    decoder = json.JSONDecoder()
    pending = [(call.name, json.loads(call.arguments)) for call in calls]
    spans: list[tuple[int, int, Any]] = []
    position = 0
    while pending:
        starts = [i for i in (text.find("{", position), text.find("[", position)) if i >= 0]
        if not starts:
            names = ", ".join(name for name, _ in pending)
            raise CallsNotFound(f"no JSON value holds the arguments of {names} in {text!r}")
        start = min(starts)
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            position = start + 1
            continue
        held = _calls_held(value, pending)
        if held:
            spans.append((start, end, value))
            pending = pending[held:]
            position = end
        else:
            position = start + 1
    return spans


def _objects(value: Any) -> list[tuple[dict[str, Any], int]]:
    """Every object in ``value`` in document order, each with the index just past its own nested objects."""
    found: list[tuple[dict[str, Any], int]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            index = len(found)
            found.append((node, 0))
            for child in node.values():
                walk(child)
            found[index] = (node, len(found))
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk(value)
    return found


def _calls_held(value: Any, pending: list[tuple[str, Any]]) -> int:
    """How many of the ``pending`` calls, in order, have their arguments in ``value``."""
    objects = _objects(value)
    index = held = 0
    for name, arguments in pending:
        match = _find_object(objects, index, name, arguments)
        if match is None:
            break
        held += 1
        index = objects[match][1]  # past the matched object and what it holds
    return held


def _find_object(objects: list[tuple[dict[str, Any], int]], start: int, name: str, arguments: Any) -> int | None:
    for position in range(start, len(objects)):
        node = objects[position][0]
        if name in node.values() and any(child == arguments for child in node.values() if isinstance(child, dict)):
            return position
    for position in range(start, len(objects)):
        if objects[position][0] == arguments:
            return position
    return None


def _respell_json(text: str, calls: Sequence[ToolCall], wanted: list[Any], spelling: str) -> str | None:
    spans = json_spans(text, calls)
    names = [call.name for call in calls]
    pieces: list[str] = []
    position = 0
    for start, end, value in spans:
        if spelling == "string_arguments":
            value, changed = _arguments_as_text(value, names, wanted)
            if not changed:
                return None
        pieces += [text[position:start], _write_json(value, spelling)]
        position = end
    pieces.append(text[position:])
    return "".join(pieces)


def _arguments_as_text(value: Any, names: list[str], wanted: list[Any]) -> tuple[Any, bool]:
    """``value`` with each call object's arguments replaced by their JSON text, and whether any was."""
    changed = False

    def swap(node: Any) -> Any:
        nonlocal changed
        if isinstance(node, list):
            return [swap(child) for child in node]
        if not isinstance(node, dict):
            return node
        if any(name in node.values() for name in names):
            for key, child in node.items():
                if isinstance(child, dict) and child in wanted:
                    changed = True
                    return {**node, key: json.dumps(child, ensure_ascii=False)}
        return {key: swap(child) for key, child in node.items()}

    return swap(value), changed


def _reordered(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _reordered(value[key]) for key in reversed(list(value))}
    if isinstance(value, list):
        return [_reordered(child) for child in value]
    return value


def _write_json(value: Any, spelling: str) -> str:
    if spelling == "ascii_escapes":
        return json.dumps(value, ensure_ascii=True)
    if spelling == "compact":
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if spelling == "indented":
        return json.dumps(value, ensure_ascii=False, indent=2)
    if spelling == "escaped_slashes":  # "/" occurs in JSON only inside strings
        return json.dumps(value, ensure_ascii=False).replace("/", "\\/")
    if spelling == "keys_reordered":
        return json.dumps(_reordered(value), ensure_ascii=False)
    if spelling == "string_arguments":
        return json.dumps(value, ensure_ascii=False)
    raise ValueError(f"unknown JSON spelling {spelling!r}")


# -- Python -----------------------------------------------------------------------------------------------


def python_spans(text: str, calls: Sequence[ToolCall]) -> list[tuple[int, int]]:
    """``(start, end)`` of each call written as ``name(key=literal, ...)`` in ``text``, in order.

    Raises :class:`CallsNotFound` when a call is not found with its arguments.
    """
    spans: list[tuple[int, int]] = []
    position = 0
    for call in calls:
        arguments = json.loads(call.arguments)
        found = None
        for match in re.finditer(rf"(?<![\w.]){re.escape(call.name)}\s*\(", text[position:]):
            start = position + match.start()
            end = _call_end(text, start, call.name, arguments)
            if end is not None:
                found = (start, end)
                break
        if found is None:
            raise CallsNotFound(f"call {call.name}({_keywords(arguments)}) is not in {text!r}")
        spans.append(found)
        position = found[1]
    return spans


def _keywords(arguments: dict[str, Any]) -> str:
    return ", ".join(f"{key}=..." for key in arguments)


def _call_end(text: str, start: int, name: str, arguments: Any) -> int | None:
    """The end of the call expression at ``start`` if it is ``name(...)`` with exactly ``arguments``."""
    close = text.find(")", start)
    while close >= 0:
        try:
            node = ast.parse(text[start : close + 1], mode="eval").body
        except (SyntaxError, ValueError, RecursionError):
            close = text.find(")", close + 1)
            continue
        if _is_call_with(node, name, arguments):
            return close + 1
        return None
    return None


def _is_call_with(node: ast.expr, name: str, arguments: Any) -> bool:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name) or node.args:
        return False
    try:
        found = {keyword.arg: _as_json(ast.literal_eval(keyword.value)) for keyword in node.keywords}
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return False
    return None not in found and found == arguments


def _as_json(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_as_json(item) for item in value]
    if isinstance(value, dict):
        return {key: _as_json(item) for key, item in value.items()}
    return value


def _respell_python(text: str, calls: Sequence[ToolCall], wanted: list[Any], spelling: str) -> str:
    pieces: list[str] = []
    position = 0
    for (start, end), call, arguments in zip(python_spans(text, calls), calls, wanted, strict=True):
        pieces += [text[position:start], python_call(call.name, arguments, spelling)]
        position = end
    pieces.append(text[position:])
    return "".join(pieces)


def python_call(name: str, arguments: dict[str, Any], spelling: str = "") -> str:
    """``name(key=value, ...)`` with the values as Python literals, in one of :data:`PYTHON_SPELLINGS`."""
    equals = " = " if spelling == "spaced" else "="
    parts = [f"{key}{equals}{python_literal(value, spelling)}" for key, value in arguments.items()]
    if spelling == "trailing_comma" and parts:
        return f"{name}({', '.join(parts)},)"
    if spelling == "spaced" and parts:
        return f"{name}( {' , '.join(parts)} )"
    return f"{name}({', '.join(parts)})"


def python_literal(value: Any, spelling: str = "") -> str:
    """A Python literal for the JSON value ``value``, spelled as :func:`python_call` says."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if spelling == "exponent_floats":
            short = f"{value:e}"
            return short if float(short) == value else f"{value:.17e}"
        return repr(value)
    if isinstance(value, str):
        return _python_string(
            value, quote="'" if spelling == "single_quotes" else '"', ascii=spelling == "ascii_escapes"
        )
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(item, spelling) for item in value) + "]"
    if isinstance(value, dict):
        return (
            "{"
            + ", ".join(
                f"{python_literal(key, spelling)}: {python_literal(item, spelling)}" for key, item in value.items()
            )
            + "}"
        )
    raise TypeError(f"not a JSON value: {value!r}")


_SHORT_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _python_string(text: str, *, quote: str, ascii: bool) -> str:
    out = []
    for char in text:
        code = ord(char)
        if char in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[char])
        elif char == quote:
            out.append("\\" + quote)
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\x{code:02x}")
        elif ascii and code > 0x7F:
            out.append(f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}")
        else:
            out.append(char)
    return quote + "".join(out) + quote
