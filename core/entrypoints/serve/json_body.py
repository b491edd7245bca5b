"""Request bodies parsed off the event loop, in pieces, so a body of tens of MB never stalls other clients.

FastAPI parses a body with one ``json.loads`` on the event loop: for a
30 MB ``input`` of 400k items that is seconds during which nothing else is
answered, ``/health`` included.  :func:`read_json_body` parses in a worker
thread instead, and :func:`loads_in_pieces` decodes each array of the
object and array (down to a few levels) a member at a time: ``json.loads``
is one C call that holds the GIL throughout, so a thread running it whole
would stall the loop just the same.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from patchbay.entrypoints.serve.protocol import APIError

Body = TypeVar("Body", bound=BaseModel)

_SPACE = re.compile(r"[ \t\n\r]*")
_SCAN = json.JSONDecoder().scan_once  # type: ignore[attr-defined] # set by __init__, missing from the stubs
"""The C scanner behind ``json.loads``: one value from an index, ``StopIteration`` where there is none."""


async def read_json_body(request: Request, model: type[Body]) -> Body:
    """The request's JSON body as ``model``, parsed (:func:`loads_in_pieces`) and validated in a worker thread.

    Not JSON: a 400; a field pydantic refuses: :class:`RequestValidationError`, answered as a 400 naming it (as
    FastAPI would)."""
    raw = await request.body()
    return await asyncio.to_thread(_parse, raw, model)


def _parse(raw: bytes, model: type[Body]) -> Body:
    try:
        data = loads_in_pieces(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except (ValueError, RecursionError):
        raise APIError(400, "the body is not valid JSON, or is nested too deeply") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


PIECEWISE_DEPTH = 2
"""Objects and arrays this deep or shallower are decoded a member at a time (the body's fields, and the items of
its lists: ``input.0`` whole); deeper values, and scalars, in one call each."""


def loads_in_pieces(text: str) -> Any:
    """``json.loads(text)``, with objects and arrays down to :data:`PIECEWISE_DEPTH` decoded a member at a time.
    Raises ``ValueError`` for text that is not one JSON value."""
    try:
        found, end = _value(text, _skip(text, 0), 1)
    except StopIteration as stop:  # the C scanner's way of saying "no value here"
        raise ValueError(f"expected a value at character {stop.value}") from None
    if _skip(text, end) != len(text):
        raise ValueError(f"extra data at character {end}")
    return found


def _value(text: str, index: int, depth: int) -> tuple[Any, int]:
    if depth <= PIECEWISE_DEPTH:
        if text.startswith("{", index):
            return _object(text, index, depth)
        if text.startswith("[", index):
            return _array(text, index, depth)
    return _SCAN(text, index)


def _skip(text: str, index: int) -> int:
    return _SPACE.match(text, index).end()  # type: ignore[union-attr] # matches the empty string too


def _object(text: str, index: int, depth: int) -> tuple[dict[str, Any], int]:
    found: dict[str, Any] = {}
    index = _skip(text, index + 1)
    if text.startswith("}", index):
        return found, index + 1
    while True:
        if not text.startswith('"', index):
            raise ValueError(f"an object key must be a string (character {index})")
        key, index = _SCAN(text, index)
        index = _skip(text, index)
        if not text.startswith(":", index):
            raise ValueError(f"expected ':' at character {index}")
        found[key], index = _value(text, _skip(text, index + 1), depth + 1)
        index = _skip(text, index)
        mark = text[index : index + 1]
        if mark == "}":
            return found, index + 1
        if mark != ",":
            raise ValueError(f"expected ',' or '}}' at character {index}")
        index = _skip(text, index + 1)


def _array(text: str, index: int, depth: int) -> tuple[list[Any], int]:
    items: list[Any] = []
    index = _skip(text, index + 1)
    if text.startswith("]", index):
        return items, index + 1
    inner = depth + 1
    while True:
        item, index = _value(text, index, inner) if inner <= PIECEWISE_DEPTH else _SCAN(text, index)
        items.append(item)
        index = _skip(text, index)
        mark = text[index : index + 1]
        if mark == "]":
            return items, index + 1
        if mark != ",":
            raise ValueError(f"expected ',' or ']' at character {index}")
        index = _skip(text, index + 1)
