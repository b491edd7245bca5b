"""Mistral tool calls: content, then ``[TOOL_CALLS]`` and a JSON list of ``{"name": ..., "arguments": {...}}``."""

from __future__ import annotations

import json
from collections.abc import Sequence

from patchbay.interfaces import ParsedToolCalls, ToolCall, ToolCallDelta, ToolCallDeltaItem, ToolCallStream, ToolParser
from patchbay.interfaces.parsing import decode_json, partial_marker_length, tool_call_of

MARKER = "[TOOL_CALLS]"


def _calls_in(payload: str) -> list[ToolCall] | None:
    """The calls of the JSON after the marker (a list of call objects, or one object), or ``None`` if malformed."""
    ok, value = decode_json(payload)
    if not ok:
        return None
    values = value if isinstance(value, list) else [value]
    calls = [tool_call_of(item) for item in values]
    if not calls or any(call is None for call in calls):
        return None
    return calls  # type: ignore[return-value]


class MistralToolParser(ToolParser):
    """Mistral 7B v0.3 / Nemo / Small format: ``[TOOL_CALLS]`` then a JSON list of calls to the end of the output.

    Text before the marker is content.  If the JSON after it is malformed,
    the whole output is content.  ``[TOOL_CALLS]`` is a special token in
    Mistral tokenizers: serve such models with special tokens kept in the
    output text, or the marker never reaches the parser.
    """

    contract_version = "1.2"

    def parse(self, text: str) -> ParsedToolCalls:
        start = text.find(MARKER)
        if start < 0:
            return ParsedToolCalls(text)
        calls = _calls_in(text[start + len(MARKER) :])
        return ParsedToolCalls(text) if calls is None else ParsedToolCalls(text[:start], tuple(calls))

    def stream(self) -> ToolCallStream:
        return _MistralStream()

    def render(self, content: str, tool_calls: Sequence[ToolCall]) -> str:
        if not tool_calls:
            return content
        payload = [{"name": call.name, "arguments": json.loads(call.arguments)} for call in tool_calls]
        return f"{content}{MARKER}{json.dumps(payload, ensure_ascii=False)}"


class _MistralStream(ToolCallStream):
    """Content streams until the marker (a partial marker held back); the calls are told when the output ends."""

    def __init__(self) -> None:
        self._buffer = ""
        self._in_calls = False

    def feed(self, text: str) -> ToolCallDelta:
        self._buffer += text
        if self._in_calls:
            return ToolCallDelta()
        start = self._buffer.find(MARKER)
        if start >= 0:
            content, self._buffer = self._buffer[:start], self._buffer[start:]
            self._in_calls = True
            return ToolCallDelta(content)
        keep = partial_marker_length(self._buffer, MARKER)
        content, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep :]
        return ToolCallDelta(content)

    def finish(self) -> ToolCallDelta:
        held, self._buffer = self._buffer, ""
        if not self._in_calls:
            return ToolCallDelta(held)
        calls = _calls_in(held[len(MARKER) :])
        if calls is None:
            return ToolCallDelta(held)
        return ToolCallDelta(
            "", tuple(ToolCallDeltaItem(index, call.name, call.arguments) for index, call in enumerate(calls))
        )
