"""Correct third-party tool parsers of two formats no built-in reads, written as a plugin author would.

The broken fixtures of ``broken_parsers.py`` each change one thing in one of these (or in a built-in), so
that the defect alone is what the kit must catch; these two must pass the whole kit.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Sequence
from typing import Any

from patchbay.interfaces import (
    ParsedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolCallDeltaItem,
    ToolCallStream,
    ToolParser,
    ToolParserCapabilities,
)
from patchbay.interfaces.parsing import tool_call_of


class WholeTextStream(ToolCallStream):
    """Holds every piece back and tells the whole parse at the end (always right; never early)."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._pieces: list[str] = []

    def feed(self, text: str) -> ToolCallDelta:
        self._pieces.append(text)
        return ToolCallDelta()

    def finish(self) -> ToolCallDelta:
        parsed = self._parser.parse("".join(self._pieces))
        self._pieces = []
        items = tuple(ToolCallDeltaItem(i, call.name, call.arguments) for i, call in enumerate(parsed.tool_calls))
        return ToolCallDelta(parsed.content, items)


class NotACall(ValueError):
    """A list item or argument that is not a call of Python literals."""


class PythonicToolParser(ToolParser):
    """Pythonic calls (Llama 3.2, Llama 4): the whole answer is a Python list of calls ``[f(a=1), g(b="x")]``."""

    contract_version = "1.2"
    capabilities = ToolParserCapabilities(content_with_calls=False, arguments_syntax="python")

    def parse(self, text: str) -> ParsedToolCalls:
        body = text.strip()
        if not body.startswith("["):
            return ParsedToolCalls(text)
        try:
            calls = self.calls_of(body)
        except (NotACall, SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return ParsedToolCalls(text)
        return ParsedToolCalls("", tuple(calls)) if calls else ParsedToolCalls(text)

    def calls_of(self, body: str) -> list[ToolCall]:
        """The calls of a text that starts with ``[``; raises when it is not a list of calls of literals."""
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List):
            raise NotACall("not a list")
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                raise NotACall("not a call with keyword arguments")
            arguments = {}
            for keyword in node.keywords:
                if keyword.arg is None:
                    raise NotACall("**arguments")
                arguments[keyword.arg] = json_value(ast.literal_eval(keyword.value))
            calls.append(ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
        return calls

    def stream(self) -> ToolCallStream:
        return PythonicStream(self)

    def render(self, content: str, tool_calls: Sequence[ToolCall]) -> str:
        if not tool_calls:
            return content
        if content:
            raise ValueError("the pythonic format cannot hold content next to calls")
        written = []
        for call in tool_calls:
            arguments = ", ".join(f"{key}={value!r}" for key, value in json.loads(call.arguments).items())
            written.append(f"{call.name}({arguments})")
        return "[" + ", ".join(written) + "]"


def json_value(value: Any) -> Any:
    """A Python literal as a JSON value (tuples are lists); anything JSON cannot hold raises :class:`NotACall`."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise NotACall("a float JSON cannot hold")
        return value
    if isinstance(value, list | tuple):
        return [json_value(item) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {key: json_value(item) for key, item in value.items()}
    raise NotACall(f"not a JSON value: {type(value).__name__}")


class PythonicStream(ToolCallStream):
    """Undecided until the first visible character: ``[`` holds everything to the end, anything else is content."""

    def __init__(self, parser: PythonicToolParser) -> None:
        self._parser = parser
        self._held = ""
        self._mode = "undecided"

    def feed(self, text: str) -> ToolCallDelta:
        if self._mode == "content":
            return ToolCallDelta(text)
        self._held += text
        if self._mode == "undecided" and self._held.strip():
            self._mode = "calls" if self._held.lstrip().startswith("[") else "content"
            if self._mode == "content":
                held, self._held = self._held, ""
                return ToolCallDelta(held)
        return ToolCallDelta()

    def finish(self) -> ToolCallDelta:
        held, self._held = self._held, ""
        if self._mode == "content":
            return ToolCallDelta()
        parsed = self._parser.parse(held)
        items = tuple(ToolCallDeltaItem(i, call.name, call.arguments) for i, call in enumerate(parsed.tool_calls))
        return ToolCallDelta(parsed.content, items)


OPEN = "<function="
CLOSE = "</function>"


class FunctionTagToolParser(ToolParser):
    """``<function=NAME>{json arguments}</function>`` calls (Llama 3.1's custom-tool form), any number, text
    around; a call whose JSON is malformed or unclosed stays content."""

    contract_version = "1.2"

    def parse(self, text: str) -> ParsedToolCalls:
        content: list[str] = []
        calls: list[ToolCall] = []
        position = 0
        while True:
            start = text.find(OPEN, position)
            close = text.find(CLOSE, start) if start >= 0 else -1
            if start < 0 or close < 0:
                content.append(text[position:])
                return ParsedToolCalls("".join(content), tuple(calls))
            end = close + len(CLOSE)
            call = self.call_of(text[start + len(OPEN) : close])
            content.append(text[position:start] if call is not None else text[position:end])
            if call is not None:
                calls.append(call)
            position = end

    def call_of(self, inside: str) -> ToolCall | None:
        """The call of ``NAME>{json}`` (what the tags hold), or ``None``."""
        name, bracket, arguments = inside.partition(">")
        if not bracket or not name.isidentifier():
            return None
        try:
            value = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return None
        return tool_call_of({"name": name, "arguments": value})

    def stream(self) -> ToolCallStream:
        return WholeTextStream(self)

    def render(self, content: str, tool_calls: Sequence[ToolCall]) -> str:
        written = [f"{OPEN}{call.name}>{call.arguments}{CLOSE}" for call in tool_calls]
        return content + "".join(written)
