"""``<think> reasoning </think> answer``: the markup of Qwen3, DeepSeek-R1, SmolLM3 and most open reasoning models."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from patchbay.interfaces import ReasoningDelta, ReasoningParser, ReasoningSplit, ReasoningStream
from patchbay.interfaces.parsing import partial_marker_length

OPEN = "<think>"
CLOSE = "</think>"


class ThinkOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    starts_in_reasoning: bool = False
    """The chat template opens ``<think>`` in the prompt (DeepSeek-R1's does): the output begins inside the
    reasoning even without its own ``<think>``, and everything up to ``</think>`` is reasoning."""


class ThinkReasoningParser(ReasoningParser):
    """Reasoning is what an output opening with ``<think>`` (after whitespace) says before ``</think>``.

    The answer is what follows ``</think>``, leading whitespace removed; an
    output that never closes its reasoning has an empty answer.  An output
    that does not open with ``<think>`` is all answer (unless
    ``starts_in_reasoning``).
    """

    contract_version = "1.2"

    Options = ThinkOptions
    options: ThinkOptions  # an instance of Options: plugin_options() validated it

    def parse(self, text: str) -> ReasoningSplit:
        head = text.lstrip()
        if head.startswith(OPEN):
            body = head[len(OPEN) :]
        elif self.options.starts_in_reasoning:
            body = text
        else:
            return ReasoningSplit(None, text)
        close = body.find(CLOSE)
        if close < 0:
            return ReasoningSplit(body, "")
        return ReasoningSplit(body[:close], body[close + len(CLOSE) :].lstrip())

    def stream(self) -> ReasoningStream:
        return _ThinkStream(self.options.starts_in_reasoning)

    def render(self, reasoning: str | None, content: str) -> str:
        if reasoning is None:
            return content
        return f"{OPEN}{reasoning}{CLOSE}\n\n{content}"


class _ThinkStream(ReasoningStream):
    """Phases: ``start`` (is there a ``<think>``?), ``reasoning`` (until ``</think>``), ``answer``."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        self._starts_in_reasoning = starts_in_reasoning
        self._phase = "start"
        self._buffer = ""
        self._answer_begun = False
        self._has_reasoning = False

    @property
    def has_reasoning(self) -> bool:
        return self._has_reasoning

    def feed(self, text: str) -> ReasoningDelta:
        self._buffer += text
        reasoning: list[str] = []
        answer: list[str] = []
        if self._phase == "start":
            head = self._buffer.lstrip()
            if head.startswith(OPEN):
                self._enter_reasoning(head[len(OPEN) :])
            elif head and not OPEN.startswith(head):
                if self._starts_in_reasoning:
                    self._enter_reasoning(self._buffer)
                else:
                    self._phase, self._answer_begun = "answer", True
        if self._phase == "reasoning":
            close = self._buffer.find(CLOSE)
            if close < 0:
                keep = partial_marker_length(self._buffer, CLOSE)
                reasoning.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
            else:
                reasoning.append(self._buffer[:close])
                self._buffer = self._buffer[close + len(CLOSE) :]
                self._phase = "answer"
        if self._phase == "answer":
            answer.append(self._answer(self._buffer))
            self._buffer = ""
        return ReasoningDelta("".join(reasoning), "".join(answer))

    def finish(self) -> ReasoningDelta:
        held, self._buffer = self._buffer, ""
        if self._phase == "start":
            if self._starts_in_reasoning:
                self._has_reasoning = True
                return ReasoningDelta(reasoning=held)
            return ReasoningDelta(content=held)
        if self._phase == "reasoning":
            return ReasoningDelta(reasoning=held)
        return ReasoningDelta()

    def _enter_reasoning(self, rest: str) -> None:
        self._phase, self._buffer, self._has_reasoning = "reasoning", rest, True

    def _answer(self, text: str) -> str:
        if not self._answer_begun:
            text = text.lstrip()
            self._answer_begun = bool(text)
        return text
