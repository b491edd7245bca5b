"""Hermes / Qwen tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, text around."""

from __future__ import annotations

import json
from collections.abc import Sequence

from patchbay.interfaces import ParsedToolCalls, ToolCall, ToolCallDelta, ToolCallDeltaItem, ToolCallStream, ToolParser
from patchbay.interfaces.parsing import decode_json, partial_marker_length, tool_call_of

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def _call_in(body: str) -> ToolCall | None:
    ok, value = decode_json(body)
    return tool_call_of(value) if ok else None


class HermesToolParser(ToolParser):
    """Hermes 2 Pro / Qwen 2.5+ format: each call is a JSON object between ``<tool_call>`` and ``</tool_call>``.

    An unclosed last call (the output hit its limit) still counts if its JSON
    is whole; a call whose JSON is malformed stays in the content, tags and all.
    """

    contract_version = "1.2"

    def parse(self, text: str) -> ParsedToolCalls:
        content: list[str] = []
        calls: list[ToolCall] = []
        position = 0
        while True:
            start = text.find(OPEN, position)
            if start < 0:
                content.append(text[position:])
                break
            content.append(text[position:start])
            close = text.find(CLOSE, start + len(OPEN))
            end = len(text) if close < 0 else close + len(CLOSE)
            call = _call_in(text[start + len(OPEN) : close if close >= 0 else end])
            if call is None:
                content.append(text[start:end])
            else:
                calls.append(call)
            position = end
        return ParsedToolCalls("".join(content), tuple(calls))

    def stream(self) -> ToolCallStream:
        return _HermesStream()

    def render(self, content: str, tool_calls: Sequence[ToolCall]) -> str:
        rendered = [
            f"{OPEN}\n{json.dumps({'name': call.name, 'arguments': json.loads(call.arguments)}, ensure_ascii=False)}"
            f"\n{CLOSE}"
            for call in tool_calls
        ]
        return content + "".join(rendered)


class _HermesStream(ToolCallStream):
    """Content passes through (a partial ``<tool_call>`` held back); each call is told whole once it closes."""

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        self._calls = 0

    def feed(self, text: str) -> ToolCallDelta:
        self._buffer += text
        content: list[str] = []
        items: list[ToolCallDeltaItem] = []
        while True:
            if not self._in_call:
                start = self._buffer.find(OPEN)
                if start < 0:
                    keep = partial_marker_length(self._buffer, OPEN)
                    content.append(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start:]
                self._in_call = True
            else:
                close = self._buffer.find(CLOSE, len(OPEN))
                if close < 0:
                    break
                end = close + len(CLOSE)
                self._settle(self._buffer[len(OPEN) : close], self._buffer[:end], content, items)
                self._buffer = self._buffer[end:]
                self._in_call = False
        return ToolCallDelta("".join(content), tuple(items))

    def finish(self) -> ToolCallDelta:
        content: list[str] = []
        items: list[ToolCallDeltaItem] = []
        if self._in_call:
            self._settle(self._buffer[len(OPEN) :], self._buffer, content, items)
        else:
            content.append(self._buffer)
        self._buffer, self._in_call = "", False
        return ToolCallDelta("".join(content), tuple(items))

    def _settle(self, body: str, segment: str, content: list[str], items: list[ToolCallDeltaItem]) -> None:
        call = _call_in(body)
        if call is None:
            content.append(segment)
            return
        items.append(ToolCallDeltaItem(self._calls, call.name, call.arguments))
        self._calls += 1
