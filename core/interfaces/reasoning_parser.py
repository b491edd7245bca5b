"""Reasoning parsers: split a model's thinking (``reasoning_content``) from its answer (``content``).

Reasoning models write their chain of thought in markup (``<think> ... </think>``)
before the answer.  A parser splits the finished text
(:meth:`ReasoningParser.parse`) or the streamed pieces
(:meth:`ReasoningParser.stream`); the streamed deltas of any split of a text
add up to the whole parse.  Text the parser cannot read (an unclosed or stray
tag) is never an exception.

What the contract says of model-written text:

- an output cut inside its reasoning (``max_tokens`` reached before the
  closing markup) is reasoning, with an empty answer, never content;
- whitespace before the opening markup is not content, and whitespace
  between the reasoning and the answer may be dropped (the conformance kit
  compares reasoning and answers with surrounding whitespace ignored);
- ``content`` is always a string (``""`` for none); ``reasoning`` is
  ``None`` only when the output has no reasoning section.

One parser object serves every request of a run: :meth:`ReasoningParser.parse`
and :meth:`ReasoningParser.stream` may be called while other streams of the
same parser are open, interleaved and from several threads.  Keep
per-output state in the stream object, which lives for one output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from pydantic import BaseModel

from patchbay.interfaces.base import Capabilities, Plugin, ServingConfig


@dataclass(frozen=True)
class ReasoningSplit:
    """A whole output split in two."""

    reasoning: str | None
    """The thinking, without its markup; ``None`` when the output has no reasoning section."""
    content: str
    """The answer."""


@dataclass(frozen=True)
class ReasoningDelta:
    """What one streamed piece adds to the reasoning and to the content."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


class ReasoningStream(ABC):
    """The state of splitting one streamed output; made by :meth:`ReasoningParser.stream`, fed by one thread at a
    time: every piece in order, then :meth:`finish` once.  Other streams of the same parser may be open meanwhile."""

    @abstractmethod
    def feed(self, text: str) -> ReasoningDelta:
        """Take the next piece; return what is certain so far (a partial tag is held back)."""

    @abstractmethod
    def finish(self) -> ReasoningDelta:
        """The output has ended: return what was held back."""

    @property
    @abstractmethod
    def has_reasoning(self) -> bool:
        """Whether the output has a reasoning section (known once it has begun; final after :meth:`finish`)."""


@dataclass(frozen=True)
class ReasoningParserCapabilities(Capabilities):
    """What a reasoning parser declares.  Parsers run on the host on text, whatever the model's device and dtype."""

    devices: tuple[str, ...] = ("cpu", "cuda", "mps", "xpu")

    def reasons(self, config: ServingConfig) -> list[str]:
        return []  # text in, text out: no device or dtype is out of reach


class ReasoningParser(Plugin):
    """Splits one reasoning markup; chosen by ``chat: {reasoning_parser: NAME}`` or a request's ``reasoning_parser``."""

    kind: ClassVar[str] = "reasoning_parser"
    capabilities: ClassVar[ReasoningParserCapabilities] = ReasoningParserCapabilities()

    def __init__(self, options: BaseModel | None = None) -> None:
        """Keep the validated options; a parser holds no per-request state (see :meth:`stream`)."""
        self.options = options if options is not None else self.Options()

    @abstractmethod
    def parse(self, text: str) -> ReasoningSplit:
        """Split a finished output.  Never raises."""

    @abstractmethod
    def stream(self) -> ReasoningStream:
        """A fresh incremental splitter for one output, whose deltas add up to :meth:`parse` of the whole text.

        Each call returns a new object sharing no mutable state with the others or with the parser.
        """

    @abstractmethod
    def render(self, reasoning: str | None, content: str) -> str:
        """Write ``reasoning`` and ``content`` the way a model using this markup would (:meth:`parse` gives them
        back); used by the conformance suite, which finds the reasoning in the text to cut the output inside it,
        so write both as they are, inside the markup."""
