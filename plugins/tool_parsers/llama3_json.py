"""Llama 3.x JSON tool calls: the whole answer is ``{"name": ..., "parameters": {...}}`` objects, ``;``-separated."""

from __future__ import annotations

import json
from collections.abc import Sequence

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

PYTHON_TAG = "<|python_tag|>"


def _calls_in(body: str) -> list[ToolCall] | None:
    """The calls of ``body`` (JSON objects separated by ``;`` and whitespace), or ``None`` if any is malformed."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    position = 0
    while True:
        while position < len(body) and body[position].isspace():
            position += 1
        if position == len(body):
            break
        try:
            value, position = decoder.raw_decode(body, position)
        except (json.JSONDecodeError, RecursionError):
            return None
        call = tool_call_of(value)
        if call is None:
            return None
        calls.append(call)
        while position < len(body) and body[position].isspace():
            position += 1
        if position < len(body):
            if body[position] != ";":
                return None
            position += 1
    return calls or None


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1-3.3 JSON format: an answer that starts with ``{`` (or ``<|python_tag|>``) is one or more calls
    ``{"name": ..., "parameters": {...}}`` separated by ``;``; any other answer is content.

    The format has no closing marker, so a streamed answer that starts like a
    call is held back and told whole when the output ends.
    """

    contract_version = "1.2"

    capabilities = ToolParserCapabilities(content_with_calls=False)

    def parse(self, text: str) -> ParsedToolCalls:
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :]
        elif not body.startswith("{"):
            return ParsedToolCalls(text)
        calls = _calls_in(body)
        return ParsedToolCalls(text) if calls is None else ParsedToolCalls("", tuple(calls))

    def stream(self) -> ToolCallStream:
        return _Llama3Stream(self)

    def render(self, content: str, tool_calls: Sequence[ToolCall]) -> str:
        if not tool_calls:
            return content
        if content:
            raise ValueError("the Llama 3 JSON format cannot hold content next to calls")
        return "; ".join(
            json.dumps({"name": call.name, "parameters": json.loads(call.arguments)}, ensure_ascii=False)
            for call in tool_calls
        )


class _Llama3Stream(ToolCallStream):
    """Undecided until the first visible characters; then content streams, or calls wait for the end."""

    def __init__(self, parser: Llama3JsonToolParser) -> None:
        self._parser = parser
        self._buffer = ""
        self._mode = "undecided"  # -> "content" or "calls"

    def feed(self, text: str) -> ToolCallDelta:
        if self._mode == "content":
            return ToolCallDelta(text)
        self._buffer += text
        if self._mode == "undecided":
            head = self._buffer.lstrip()
            if head.startswith(("{", PYTHON_TAG)):
                self._mode = "calls"
            elif head and not PYTHON_TAG.startswith(head):
                self._mode = "content"
                held, self._buffer = self._buffer, ""
                return ToolCallDelta(held)
        return ToolCallDelta()

    def finish(self) -> ToolCallDelta:
        if self._mode == "content":
            return ToolCallDelta()
        parsed = self._parser.parse(self._buffer)
        self._buffer = ""
        return ToolCallDelta(
            parsed.content,
            tuple(ToolCallDeltaItem(index, call.name, call.arguments) for index, call in enumerate(parsed.tool_calls)),
        )
