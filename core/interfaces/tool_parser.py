"""Tool-call parsers: model text in, OpenAI-style tool calls out, whole or as streamed deltas.

A chat model asked to call tools answers in its own format (Hermes and Qwen
wrap a JSON object in ``<tool_call>`` tags, Llama 3 writes bare JSON objects,
Mistral prefixes a JSON list with ``[TOOL_CALLS]``).  A parser turns such text
into the ordinary content plus a list of :class:`ToolCall`, either from the
finished text (:meth:`ToolParser.parse`) or piece by piece while the model
streams (:meth:`ToolParser.stream`).  The two must agree: whatever way the
text is cut into pieces, the pieces' deltas add up to the whole parse.

A call whose JSON is malformed is not a call: its text comes back as content,
never as an exception, and every call's ``arguments`` is a JSON object text.
Arguments a model wrote as the text of a JSON object (``"arguments":
"{\"x\": 1}"``) are that object.  Parsers work on text only; the server
assigns call ids, and turns content that is only whitespace next to calls
into ``null`` (a parser's ``content`` is always a string, ``""`` for none).

One parser object serves every request of a run: :meth:`ToolParser.parse`
and :meth:`ToolParser.stream` may be called while other streams of the same
parser are open, interleaved and from several threads.  Keep per-output
state in the stream object, which lives for one output: made when it
begins, fed its pieces in order by one thread at a time, finished once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pydantic import BaseModel

from patchbay.interfaces.base import Capabilities, Plugin, ServingConfig


@dataclass(frozen=True)
class ToolCall:
    """One function call the model made."""

    name: str
    """The function's name."""
    arguments: str
    """Its arguments: the text of one JSON object (``"{}"`` for none)."""


@dataclass(frozen=True)
class ParsedToolCalls:
    """A whole text split into what the model said and the calls it made."""

    content: str
    """The text outside the calls (malformed calls included, as they were written)."""
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class ToolCallDeltaItem:
    """A piece of call number ``index`` (0-based, in order of appearance), in OpenAI's streaming shape."""

    index: int
    name: str | None = None
    """Set in the first piece of a call, ``None`` after."""
    arguments: str = ""
    """More of the arguments' JSON text; the pieces of one call concatenate to its ``arguments``."""


@dataclass(frozen=True)
class ToolCallDelta:
    """What one piece of streamed text adds: content and pieces of calls."""

    content: str = ""
    tool_calls: tuple[ToolCallDeltaItem, ...] = field(default_factory=tuple)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


class ToolCallStream(ABC):
    """The state of parsing one streamed output; made by :meth:`ToolParser.stream`, fed by one thread at a time.

    It lives for one output: every piece in order, then :meth:`finish` once.
    Other streams of the same parser may be open at the same time.
    """

    @abstractmethod
    def feed(self, text: str) -> ToolCallDelta:
        """Take the next piece of the output; return what can be told for sure so far.

        Text that may still turn out to be part of a call (a partial opening
        tag, an unfinished call) is held back until later pieces decide it.
        """

    @abstractmethod
    def finish(self) -> ToolCallDelta:
        """The output has ended: return everything still held back, as calls or as content."""


@dataclass(frozen=True)
class ToolParserCapabilities(Capabilities):
    """What a tool-call parser declares.  Parsers run on the host on text, whatever the model's device and dtype."""

    devices: tuple[str, ...] = ("cpu", "cuda", "mps", "xpu")
    parallel_calls: bool = True
    """The format can hold several calls in one answer."""
    content_with_calls: bool = True
    """The format allows ordinary text next to calls (else an answer is either text or calls)."""
    arguments_syntax: Literal["json", "python", "other"] = "json"
    """How the format spells a call's arguments: ``json``, a JSON object (Hermes, Mistral, Llama 3);
    ``python``, keyword arguments of Python literals in a call ``name(key=value, ...)`` (pythonic formats);
    ``other``, neither.  The conformance kit re-spells the calls :meth:`ToolParser.render` writes the way
    models write this syntax (escapes, quotes, spacing, string-valued arguments) and breaks them to check
    malformed calls; with ``other`` those checks do not apply."""

    def reasons(self, config: ServingConfig) -> list[str]:
        return []  # text in, text out: no device or dtype is out of reach


class ToolParser(Plugin):
    """Parses one tool-call format; chosen by ``chat: {tool_parser: NAME}`` or a request's ``tool_parser``."""

    kind: ClassVar[str] = "tool_parser"
    capabilities: ClassVar[ToolParserCapabilities] = ToolParserCapabilities()

    def __init__(self, options: BaseModel | None = None) -> None:
        """Keep the validated options; a parser holds no per-request state (see :meth:`stream`)."""
        self.options = options if options is not None else self.Options()

    @abstractmethod
    def parse(self, text: str) -> ParsedToolCalls:
        """Split a finished output into content and calls; malformed calls stay in the content.  Never raises."""

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A fresh incremental parser for one output, whose deltas add up to :meth:`parse` of the whole text.

        Each call returns a new object sharing no mutable state with the others or with the parser.
        """

    @abstractmethod
    def render(self, content: str, tool_calls: Sequence[ToolCall]) -> str:
        """Write ``content`` and ``tool_calls`` the way a model of this format would, so that :meth:`parse` of it
        gives them back, arguments compared as decoded JSON (used by the conformance suite and by chat
        templates' examples).

        The suite asks for content next to calls only when ``content_with_calls`` is declared, and for several
        calls only when ``parallel_calls`` is; otherwise render may raise ``ValueError``.
        """
