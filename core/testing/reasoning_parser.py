"""Conformance suite for reasoning parsers: round trips, every split of a stream, stray markup.

A parser author's test file::

    from patchbay.testing import ReasoningParserSuite

    class TestMyParser(ReasoningParserSuite):
        plugin_name = "my_markup"

The suite writes reasoning and answers in the parser's own markup
(:meth:`ReasoningParser.render`) and checks that parsing gives them back,
that streaming any text (rendered, cut short at every length, noise made of
pieces of rendered texts) cut at every position, one character at a time
and in random pieces adds up to the whole parse, and that nothing raises.

Options for ``patchbay check`` come from ``PATCHBAY_TEST_REASONING_PARSER_OPTIONS`` (JSON).
"""

from __future__ import annotations

import json
import os
import random
from typing import ClassVar

import pytest

from patchbay.interfaces import (
    Capabilities,
    ReasoningDelta,
    ReasoningParser,
    ReasoningParserCapabilities,
    ReasoningSplit,
    ReasoningStream,
    ServingConfig,
)
from patchbay.testing.suite import PluginSuite
from patchbay.testing.tool_parser import splits

OPTIONS_ENV = "PATCHBAY_TEST_REASONING_PARSER_OPTIONS"
SEED = 20241128

REASONINGS = ("", "The user wants 2 + 2.\nThat is 4 < 5, so [ok] {fine}.", "Caf\u00e9 \u2615 \u2014 \u4e2d\u6587 ...")
ANSWERS = ("", "The answer is 4.", "<b>Four</b> {4} [IV]\n\nDone.")
"""Answers start with a visible character: parsers may drop whitespace between reasoning and answer."""


def streamed(stream: ReasoningStream, pieces: list[str]) -> ReasoningSplit:
    """The reasoning and answer a client puts together from the deltas of ``pieces``."""
    reasoning: list[str] = []
    content: list[str] = []
    for delta in [*(stream.feed(piece) for piece in pieces), stream.finish()]:
        assert isinstance(delta, ReasoningDelta), f"a stream returned {type(delta).__name__}, not a ReasoningDelta"
        reasoning.append(delta.reasoning)
        content.append(delta.content)
    joined = "".join(reasoning)
    assert stream.has_reasoning or not joined, "a stream sent reasoning but says the output has none"
    return ReasoningSplit(joined if stream.has_reasoning else None, "".join(content))


class ReasoningParserBaseSuite(PluginSuite):
    kind: ClassVar[str] = "reasoning_parser"
    capabilities_class: ClassVar[type[Capabilities]] = ReasoningParserCapabilities

    def unsupported_configs(self, capabilities: Capabilities) -> list[tuple[str, ServingConfig]]:
        return []  # parsers read text on the host: every device and dtype is served


class ReasoningParserSuite(ReasoningParserBaseSuite):
    """The conformance suite of the ``reasoning_parser`` kind."""

    @pytest.fixture
    def parser(self, available: type[ReasoningParser]) -> ReasoningParser:
        """The parser under test, with options from ``PATCHBAY_TEST_REASONING_PARSER_OPTIONS`` (JSON) if set."""
        options = json.loads(os.environ.get(OPTIONS_ENV) or "{}")
        return available(available.Options.model_validate(options))

    def cases(self) -> list[tuple[str | None, str]]:
        return [(reasoning, answer) for reasoning in (None, *REASONINGS) for answer in ANSWERS]

    def test_rendered_reasoning_parses_back(self, parser: ReasoningParser) -> None:
        for reasoning, answer in self.cases():
            text = parser.render(reasoning, answer)
            got = parser.parse(text)
            if reasoning is None and got.reasoning is not None:
                continue  # a parser told the output starts in its reasoning reads everything as reasoning
            assert got == ReasoningSplit(reasoning, answer), f"{text!r} parsed as {got}"

    def test_every_split_of_a_stream_adds_up_to_the_whole(self, parser: ReasoningParser) -> None:
        rng = random.Random(SEED)
        for reasoning, answer in self.cases():
            text = parser.render(reasoning, answer)
            whole = parser.parse(text)
            for pieces in splits(text, rng):
                assert streamed(parser.stream(), pieces) == whole, f"streaming {pieces!r} != parse {whole}"

    def test_outputs_cut_short_parse_alike_whole_and_streamed(self, parser: ReasoningParser) -> None:
        rng = random.Random(SEED)
        for reasoning, answer in self.cases():
            text = parser.render(reasoning, answer)
            for length in range(len(text)):
                prefix = text[:length]
                whole = parser.parse(prefix)
                cut = rng.randint(0, length)
                for pieces in ([prefix], [prefix[:cut], prefix[cut:]], list(prefix)):
                    assert streamed(parser.stream(), pieces) == whole, f"streaming {pieces!r} != parse {whole}"

    def test_stray_markup_never_raises(self, parser: ReasoningParser) -> None:
        rng = random.Random(SEED)
        texts = [parser.render(reasoning, answer) for reasoning, answer in self.cases()]
        for _ in range(300):
            fragments = []
            for _ in range(rng.randint(0, 5)):
                source = rng.choice(texts)
                start = rng.randint(0, len(source))
                fragments.append(source[start : start + rng.randint(0, 30)])
            text = "".join(fragments)
            whole = parser.parse(text)
            assert isinstance(whole, ReasoningSplit)
            cut = rng.randint(0, len(text))
            assert streamed(parser.stream(), [text[:cut], text[cut:]]) == whole, f"streaming {text!r} != parse"
