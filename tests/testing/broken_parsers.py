"""Tool and reasoning parsers, each broken on purpose in one way the kit of contract 1.1 let through.

Each is a correct parser (a built-in, or one of ``model_parsers.py``) with one defect a third-party author
wrote in the trial of issue 58, and each breaks real runs (or, for ``HasReasoningOnlyAtTheEnd``, the
stream's promise).  ``test_kit_catches.py`` runs the kit on each and expects the failure to name the defect.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, ClassVar

from model_parsers import FunctionTagToolParser, NotACall, PythonicToolParser, WholeTextStream, json_value

from patchbay.interfaces import (
    ReasoningDelta,
    ReasoningSplit,
    ReasoningStream,
    ToolCall,
    ToolCallDelta,
    ToolCallDeltaItem,
    ToolCallStream,
)
from patchbay.plugins.reasoning_parsers.think import CLOSE, OPEN, ThinkReasoningParser
from patchbay.plugins.tool_parsers.hermes import HermesToolParser

THINK_STREAM = type(ThinkReasoningParser().stream())
"""The built-in ``think`` parser's stream class (``starts_in_reasoning`` is its one argument)."""

# -- tool parsers ---------------------------------------------------------------------------------


class _SharedHermesStream(ToolCallStream):
    """A Hermes stream that starts over after each finish, so that one object serves output after output."""

    def __init__(self) -> None:
        self._inner = HermesToolParser().stream()

    def feed(self, text: str) -> ToolCallDelta:
        return self._inner.feed(text)

    def finish(self) -> ToolCallDelta:
        delta = self._inner.finish()
        self._inner = HermesToolParser().stream()
        return delta


class SharedStreamHermes(HermesToolParser):
    """Broken: one stream object, made with the parser, serves every output (concurrent requests mix)."""

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._stream = _SharedHermesStream()

    def stream(self) -> ToolCallStream:
        return self._stream


class CommaSplittingPythonic(PythonicToolParser):
    """Broken: splits items and arguments at commas outside brackets, blind to quotes (a regex's view), so
    ``note="a, b (c)"`` breaks the call apart."""

    def calls_of(self, body: str) -> list[ToolCall]:
        inner = body.strip()
        if not (inner.startswith("[") and inner.endswith("]")):
            raise NotACall("not a list")
        calls = []
        for item in _top_level_split(inner[1:-1]):
            match = re.fullmatch(r"\s*(\w+)\((.*)\)\s*", item, re.DOTALL)
            if match is None:
                raise NotACall(f"not a call: {item!r}")
            arguments = {}
            for part in _top_level_split(match[2]):
                if not part.strip():
                    continue
                key, equals, value = part.partition("=")
                if not equals or not key.strip().isidentifier():
                    raise NotACall(f"not key=value: {part!r}")
                arguments[key.strip()] = json_value(ast.literal_eval(value.strip()))
            calls.append(ToolCall(match[1], json.dumps(arguments, ensure_ascii=False)))
        return calls


def _top_level_split(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return [part for part in parts if part.strip()]


class _EagerPythonicStream(ToolCallStream):
    """Tells the calls as soon as the held text is a whole list of calls (at its ``]``); the rest is content."""

    def __init__(self, parser: PythonicToolParser) -> None:
        self._parser = parser
        self._held = ""
        self._told = False

    def feed(self, text: str) -> ToolCallDelta:
        if self._told:
            return ToolCallDelta(text)
        self._held += text
        if not self._held.lstrip().startswith("[") and self._held.strip():
            self._told, held, self._held = True, self._held, ""
            return ToolCallDelta(held)
        if self._held.rstrip().endswith("]"):
            parsed = self._parser.parse(self._held)
            if parsed.tool_calls:
                self._told, self._held = True, ""
                return ToolCallDelta("", _items(parsed.tool_calls))
        return ToolCallDelta()

    def finish(self) -> ToolCallDelta:
        held, self._held = self._held, ""
        if self._told:
            return ToolCallDelta()
        parsed = self._parser.parse(held)
        return ToolCallDelta(parsed.content, _items(parsed.tool_calls))


def _items(calls: tuple[ToolCall, ...]) -> tuple[ToolCallDeltaItem, ...]:
    return tuple(ToolCallDeltaItem(index, call.name, call.arguments) for index, call in enumerate(calls))


class EagerPythonic(PythonicToolParser):
    """Broken: its stream tells the calls at the list's ``]``, before the answer ends; text after it makes the
    whole answer content, which the stream can no longer take back."""

    def stream(self) -> ToolCallStream:
        return _EagerPythonicStream(self)


class BraceCountingFunctionTag(FunctionTagToolParser):
    """Broken: finds the end of the arguments by counting braces, so a ``}`` inside a string ends them early."""

    def call_of(self, inside: str) -> ToolCall | None:
        name, bracket, arguments = inside.partition(">")
        depth, end = 0, None
        for index, char in enumerate(arguments):
            depth += {"{": 1, "}": -1}.get(char, 0)
            if depth == 0 and char == "}":
                end = index + 1
                break
        if end is None or arguments[end:].strip():
            return None
        return super().call_of(inside)


class ReencodingHermes(HermesToolParser):
    """Broken: arguments a model wrote as the text of a JSON object are passed on re-encoded, as a JSON string."""

    def parse(self, text: str) -> Any:
        parsed = super().parse(text)
        bodies = re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.DOTALL)
        calls = []
        for call, body in zip(parsed.tool_calls, bodies, strict=False):
            try:
                written = json.loads(body).get("arguments")
            except (json.JSONDecodeError, AttributeError):
                written = None
            calls.append(ToolCall(call.name, json.dumps(written)) if isinstance(written, str) else call)
        return type(parsed)(parsed.content, tuple(calls))

    def stream(self) -> ToolCallStream:
        return WholeTextStream(self)


# -- reasoning parsers --------------------------------------------------------------------------


class StreamIgnoresStartsInReasoning(ThinkReasoningParser):
    """Broken: ``starts_in_reasoning`` is honoured by ``parse`` but not by its stream."""

    def stream(self) -> ReasoningStream:
        return THINK_STREAM(False)


class _ClassBufferStream(THINK_STREAM):  # type: ignore[misc,valid-type]
    """The ``think`` stream with its undecided text kept in a class attribute, reset by each new stream."""

    _shared: ClassVar[str] = ""

    def __init__(self, starts_in_reasoning: bool) -> None:
        super().__init__(starts_in_reasoning)
        type(self)._shared = ""

    @property
    def _buffer(self) -> str:
        return type(self)._shared

    @_buffer.setter
    def _buffer(self, value: str) -> None:
        type(self)._shared = value


class ClassAttributeBuffer(ThinkReasoningParser):
    """Broken: its streams keep undecided text in a class attribute, so a new stream wipes an open one's."""

    def stream(self) -> ReasoningStream:
        return _ClassBufferStream(self.options.starts_in_reasoning)


class _WholeSplitStream(ReasoningStream):
    """Holds every piece and tells the whole split at the end (always consistent with ``parse``)."""

    def __init__(self, parser: ThinkReasoningParser) -> None:
        self._parser = parser
        self._pieces: list[str] = []
        self._split: ReasoningSplit | None = None

    @property
    def has_reasoning(self) -> bool:
        return self._split is not None and self._split.reasoning is not None

    def feed(self, text: str) -> ReasoningDelta:
        self._pieces.append(text)
        return ReasoningDelta()

    def finish(self) -> ReasoningDelta:
        self._split = self._parser.parse("".join(self._pieces))
        return ReasoningDelta(self._split.reasoning or "", self._split.content)


class UnclosedReasoningAsContent(ThinkReasoningParser):
    """Broken: an output whose ``<think>`` never closes (cut by ``max_tokens``) is returned as content."""

    def parse(self, text: str) -> ReasoningSplit:
        split = super().parse(text)
        if split.reasoning is not None and CLOSE not in text:
            return ReasoningSplit(None, text)
        return split

    def stream(self) -> ReasoningStream:
        return _WholeSplitStream(self)


class MarkupOnlyAtTheVeryStart(ThinkReasoningParser):
    """Broken: reads reasoning only when ``<think>`` is the very first character (a leading newline makes the
    reasoning content)."""

    def parse(self, text: str) -> ReasoningSplit:
        if not text.startswith(OPEN) and not self.options.starts_in_reasoning:
            return ReasoningSplit(None, text)
        return super().parse(text)

    def stream(self) -> ReasoningStream:
        return _WholeSplitStream(self)


class _LateStream(THINK_STREAM):  # type: ignore[misc,valid-type]
    _finished = False

    @property
    def has_reasoning(self) -> bool:
        return self._finished and self._has_reasoning

    def finish(self) -> ReasoningDelta:
        delta = super().finish()
        self._finished = True
        return delta


class HasReasoningOnlyAtTheEnd(ThinkReasoningParser):
    """Broken: its stream says ``has_reasoning`` only once finished, not once reasoning has begun."""

    def stream(self) -> ReasoningStream:
        return _LateStream(self.options.starts_in_reasoning)
