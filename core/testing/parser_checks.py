"""What the two parser suites share: the option combinations they run, cuttings of a text, interleaved streams."""

from __future__ import annotations

import enum
import itertools
import json
import random
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal, Protocol, TypeVar, Union, get_args, get_origin

import pytest
from pydantic import BaseModel, ValidationError

MAX_COMBINATIONS = 16
"""Past this many combinations of finite-valued options, each option's values are tried one at a time instead."""


def finite_values(annotation: Any) -> tuple[Any, ...] | None:
    """The values an option of type ``annotation`` can take when they are few (``bool``, a ``Literal``, an
    ``Enum``, either of them or ``None``); ``None`` for any other type."""
    origin = get_origin(annotation)
    if annotation is bool:
        return (False, True)
    if origin is Literal:
        return get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return tuple(member.value for member in annotation)
    if origin in (Union, types.UnionType):
        found: list[Any] = []
        for member in get_args(annotation):
            if member is type(None):
                found.append(None)
                continue
            values = finite_values(member)
            if values is None:
                return None
            found += values
        return tuple(found)
    return None


def option_combinations(
    options_class: type[BaseModel], given: dict[str, Any] | None, *, limit: int = MAX_COMBINATIONS
) -> list[dict[str, Any]]:
    """The options each parser check runs with: ``given`` (fixed), and every combination of the finite-valued
    options it does not fix, the defaults first; the others keep their defaults.

    Each combination lists only what differs from the defaults (``{}`` is the defaults).  Past ``limit``
    combinations, each option takes each of its values with the others at their defaults.
    """
    fixed = dict(given or {})
    varied: list[tuple[str, list[Any]]] = []
    for name, field in options_class.model_fields.items():
        if name in fixed or field.is_required():
            continue
        values = finite_values(field.annotation)
        if values is None:
            continue
        default = field.get_default(call_default_factory=True)
        if isinstance(default, enum.Enum):
            default = default.value
        others = [value for value in values if value != default]
        varied.append((name, others))
    combinations: list[dict[str, Any]] = []
    total = 1
    for _, others in varied:
        total *= len(others) + 1
    if total <= limit:
        choices = [[None, *others] for _, others in varied]  # None: the default
        for picked in itertools.product(*choices):
            combination = dict(fixed)
            for (name, _), value in zip(varied, picked, strict=True):
                if value is not None:
                    combination[name] = value
            combinations.append(combination)
    else:
        combinations.append(dict(fixed))
        for name, others in varied:
            combinations += [{**fixed, name: value} for value in others]
    return combinations


ParserT = TypeVar("ParserT")


def build_parsers(parser_class: type[ParserT], given: dict[str, Any] | None) -> list[tuple[dict[str, Any], ParserT]]:
    """One parser per :func:`option_combinations` of its ``Options``, with the combination it was built with.

    A combination the options model refuses (a validator ruling out two values together) is left out; options
    ``given`` that it refuses fail the test, naming them.
    """
    options_class = parser_class.Options  # type: ignore[attr-defined]
    built = []
    for combination in option_combinations(options_class, given):
        try:
            options = options_class.model_validate(combination)
        except ValidationError as exc:
            if combination == (given or {}):
                pytest.fail(f"{parser_class.__name__}.Options refuses the options {json.dumps(combination)}: {exc}")
            continue
        built.append((combination, parser_class(options)))  # type: ignore[call-arg]
    return built


@contextmanager
def with_options(options: dict[str, Any]) -> Iterator[None]:
    """Name ``options`` in the message of a check that fails inside the block (nothing when they are the
    defaults)."""
    try:
        yield
    except (AssertionError, pytest.fail.Exception) as exc:
        if not options:
            raise
        message = exc.msg if isinstance(exc, pytest.fail.Exception) else str(exc)
        raise AssertionError(f"with options {json.dumps(options)}: {message}") from None


def splits(text: str, rng: random.Random, *, every_cut: bool = True) -> list[list[str]]:
    """Cuttings of ``text``: into two pieces at every position (or at a few random ones), one character at a
    time, and a few random cuttings into up to nine pieces."""
    if every_cut:
        found = [[text[:cut], text[cut:]] for cut in range(len(text) + 1)]
    else:
        found = [[text[:cut], text[cut:]] for cut in sorted({rng.randint(0, len(text)) for _ in range(6)})]
    found.append(list(text))
    for _ in range(4):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        found.append([text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])
    return found


class Collector(Protocol):
    """Puts one stream's deltas together, as a client does."""

    def feed(self, piece: str) -> None:
        """Feed ``piece`` to the stream and keep its delta."""

    def finish(self) -> Any:
        """Finish the stream; what the deltas add up to."""


def interleaved_results(
    parser: Any, texts: Sequence[str], collector: Callable[[Any], Collector], *, piece_size: int = 3
) -> list[Any]:
    """What streams of one parser give when their pieces are fed in turn, with ``parse`` of another text and a
    new stream (made and dropped, as a server building one per chunk would) between any two pieces."""
    streams = [parser.stream() for _ in texts]
    if len({id(stream) for stream in streams}) < len(streams):
        pytest.fail(
            f"{type(parser).__name__}.stream() returned the same object for two outputs: every call must make a "
            "new stream, since one parser serves all the requests of a run at once"
        )
    collectors = [collector(stream) for stream in streams]
    pieces = [[text[i : i + piece_size] for i in range(0, len(text), piece_size)] for text in texts]
    for step in range(max((len(p) for p in pieces), default=0)):
        for index, own in enumerate(pieces):
            if step < len(own):
                collectors[index].feed(own[step])
                parser.parse(texts[(index + 1) % len(texts)])
                parser.stream()
    return [collectors[index].finish() for index in range(len(texts))]
