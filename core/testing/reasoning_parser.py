"""Conformance suite for reasoning parsers: what the parser writes, what models write, streams, one parser shared.

A parser author's test file::

    from patchbay.testing import ReasoningParserSuite

    class TestMyParser(ReasoningParserSuite):
        plugin_name = "my_markup"

The suite knows no markup.  It writes reasoning and answers in the parser's
own markup (:meth:`ReasoningParser.render`) and checks:

- parsing gives them back, also for model-written reasoning (markup-like
  ``<``, ``</div>``, code, unicode) and answers, with whitespace before the
  markup; reasoning and answers are compared with surrounding whitespace
  ignored;
- an output cut inside its reasoning (``max_tokens``) is reasoning with an
  empty answer, never content;
- streaming any text (rendered, cut short at every length, noise made of
  pieces of rendered texts) cut at every position, one character at a time
  and in random pieces adds up to the whole parse, and ``has_reasoning`` is
  true as soon as reasoning has been streamed;
- streams of one parser fed in turn, with ``parse`` and new streams in
  between, each give what they give alone; nothing raises.

Every check runs once per combination of the parser's finite-valued options
(booleans such as ``starts_in_reasoning``, ``Literal`` and ``Enum`` fields);
options given in ``PATCHBAY_TEST_REASONING_PARSER_OPTIONS`` (JSON) or by
``patchbay check --options`` are fixed for all of them.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

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
from patchbay.testing.parser_checks import build_parsers, interleaved_results, splits, with_options
from patchbay.testing.suite import PluginSuite, options_env

OPTIONS_ENV = options_env("reasoning_parser")
SEED = 20241128

REASONINGS = ("", "The user wants 2 + 2.\nThat is 4 < 5, so [ok] {fine}.", "Caf\u00e9 \u2615 \u2014 \u4e2d\u6587 ...")
ANSWERS = ("", "The answer is 4.", "<b>Four</b> {4} [IV]\n\nDone.")
"""Answers start with a visible character: parsers may drop whitespace between reasoning and answer."""
MODEL_REASONINGS = (
    "Let me think step by step.\n\n1. a < b and b > c, so a </ c?\n2. In HTML, </div> closes a <div>; </b> too.",
    "def f(x):\n    return x < 3 and x > -1  # a </tag> inside code\n",
    "Unicode: \u00e9t\u00e9 \u2615 \U0001f914 \u4e2d\u6587\u3002 Then: 3 > 2 => yes",
)
"""Reasoning as models write it: markup-like text (no parser's own markup), code, unicode."""
MODEL_ANSWERS = ("The answer is 4.", "**Four** </b> <br/> [4]\n", "```python\nprint(4)\n```")
LEADING_WHITESPACE = ("", "\n", "\n\n  ")
"""Before the markup: a chat template that ends with a newline makes models start with one."""


class SplitCollector:
    """What a client puts together from one stream's deltas; ``has_reasoning`` must hold once reasoning came."""

    def __init__(self, stream: ReasoningStream) -> None:
        self.stream = stream
        self.reasoning: list[str] = []
        self.content: list[str] = []

    def take(self, delta: ReasoningDelta) -> None:
        """Add one delta."""
        assert isinstance(delta, ReasoningDelta), f"a stream returned {type(delta).__name__}, not a ReasoningDelta"
        self.reasoning.append(delta.reasoning)
        self.content.append(delta.content)

    def feed(self, piece: str) -> None:
        """Feed ``piece`` to the stream, take its delta and check ``has_reasoning``."""
        self.take(self.stream.feed(piece))
        sent = "".join(self.reasoning)
        assert self.stream.has_reasoning or not sent, (
            f"has_reasoning is False after the stream sent reasoning {sent!r}: it must be true once the reasoning "
            "has begun"
        )

    def finish(self) -> ReasoningSplit:
        """Finish the stream: the reasoning and answer the deltas add up to."""
        self.take(self.stream.finish())
        joined = "".join(self.reasoning)
        assert self.stream.has_reasoning or not joined, "a stream sent reasoning but says the output has none"
        return ReasoningSplit(joined if self.stream.has_reasoning else None, "".join(self.content))


def streamed(stream: ReasoningStream, pieces: list[str]) -> ReasoningSplit:
    """The reasoning and answer a client puts together from the deltas of ``pieces``."""
    collector = SplitCollector(stream)
    for piece in pieces:
        collector.feed(piece)
    return collector.finish()


def same_split(got: ReasoningSplit, reasoning: str | None, answer: str) -> bool:
    """Whether ``got`` says ``reasoning`` and ``answer``, surrounding whitespace aside."""
    if (got.reasoning is None) != (reasoning is None):
        return False
    if got.reasoning is not None and reasoning is not None and got.reasoning.strip() != reasoning.strip():
        return False
    return isinstance(got.content, str) and got.content.strip() == answer.strip()


class ReasoningParserBaseSuite(PluginSuite):
    kind: ClassVar[str] = "reasoning_parser"
    capabilities_class: ClassVar[type[Capabilities]] = ReasoningParserCapabilities

    def unsupported_configs(self, capabilities: Capabilities) -> list[tuple[str, ServingConfig]]:
        return []  # parsers read text on the host: every device and dtype is served


class ReasoningParserSuite(ReasoningParserBaseSuite):
    """The conformance suite of the ``reasoning_parser`` kind."""

    @pytest.fixture
    def parsers(self, available: type[ReasoningParser]) -> list[tuple[dict[str, Any], ReasoningParser]]:
        """The parser under test, once per combination of its finite-valued options (``{}``: the defaults)."""
        return build_parsers(available, self.given_options())

    def cases(self) -> list[tuple[str | None, str]]:
        return [(reasoning, answer) for reasoning in (None, *REASONINGS) for answer in ANSWERS]

    def test_rendered_reasoning_parses_back(self, parsers: list[tuple[dict[str, Any], ReasoningParser]]) -> None:
        for options, parser in parsers:
            with with_options(options):
                for reasoning, answer in self.cases():
                    text = parser.render(reasoning, answer)
                    got = parser.parse(text)
                    if reasoning is None and got.reasoning is not None:
                        continue  # a parser told the output starts in its reasoning reads everything as reasoning
                    assert got == ReasoningSplit(reasoning, answer), f"{text!r} parsed as {got}"

    def test_model_written_reasoning_parses_to_what_it_says(
        self, parsers: list[tuple[dict[str, Any], ReasoningParser]]
    ) -> None:
        """Markup-like reasoning and answers, with whitespace before the markup, whole and streamed."""
        rng = random.Random(SEED)
        for options, parser in parsers:
            with with_options(options):
                for reasoning in (None, *MODEL_REASONINGS):
                    for answer in MODEL_ANSWERS:
                        for space in LEADING_WHITESPACE:
                            text = space + parser.render(reasoning, answer)
                            got = parser.parse(text)
                            if reasoning is None and got.reasoning is not None:
                                continue  # read as reasoning from the start: the parser was told so
                            assert same_split(got, reasoning, answer), (
                                f"{text!r} parsed as {got}; it says reasoning {reasoning!r} and answer {answer!r}"
                                + (" (whitespace before the markup is not content)" if space else "")
                            )
                            self._check_streams(parser, text, rng, every_cut=not space)

    def test_an_output_cut_inside_its_reasoning_is_reasoning(
        self, parsers: list[tuple[dict[str, Any], ReasoningParser]]
    ) -> None:
        """``max_tokens`` reached before the reasoning closes: what was written is reasoning, the answer empty."""
        rng = random.Random(SEED)
        for options, parser in parsers:
            with with_options(options):
                for reasoning in MODEL_REASONINGS:
                    text = parser.render(reasoning, MODEL_ANSWERS[0])
                    start = text.find(reasoning)
                    assert start >= 0, (
                        f"render({reasoning!r}, ...) wrote {text!r}, which does not hold the reasoning as it is; "
                        "the kit needs it to cut the output inside the reasoning"
                    )
                    for length in (1, len(reasoning) // 2, len(reasoning)):
                        prefix = text[: start + length]
                        got = parser.parse(prefix)
                        assert same_split(got, reasoning[:length], ""), (
                            f"an output cut inside its reasoning (max_tokens reached) is reasoning with an empty "
                            f"answer: {prefix!r} parsed as {got}"
                        )
                        self._check_streams(parser, prefix, rng, every_cut=False)

    def test_every_split_of_a_stream_adds_up_to_the_whole(
        self, parsers: list[tuple[dict[str, Any], ReasoningParser]]
    ) -> None:
        rng = random.Random(SEED)
        for options, parser in parsers:
            with with_options(options):
                for reasoning, answer in self.cases():
                    self._check_streams(parser, parser.render(reasoning, answer), rng)

    def test_outputs_cut_short_parse_alike_whole_and_streamed(
        self, parsers: list[tuple[dict[str, Any], ReasoningParser]]
    ) -> None:
        rng = random.Random(SEED)
        for options, parser in parsers:
            with with_options(options):
                for reasoning, answer in self.cases():
                    text = parser.render(reasoning, answer)
                    for length in range(len(text)):
                        prefix = text[:length]
                        whole = parser.parse(prefix)
                        cut = rng.randint(0, length)
                        for pieces in ([prefix], [prefix[:cut], prefix[cut:]], list(prefix)):
                            got = streamed(parser.stream(), pieces)
                            assert got == whole, f"streaming {pieces!r} gave {got}, parse gave {whole}"

    def test_streams_of_one_parser_do_not_share_state(
        self, parsers: list[tuple[dict[str, Any], ReasoningParser]]
    ) -> None:
        """One parser serves every request of a server: streams fed in turn, with ``parse`` of other texts and
        new streams in between, each give what they give alone."""
        for options, parser in parsers:
            with with_options(options):
                texts = [
                    parser.render(reasoning, answer)
                    for reasoning, answer in zip(MODEL_REASONINGS, MODEL_ANSWERS, strict=True)
                ]
                texts += [MODEL_ANSWERS[1], parser.render(MODEL_REASONINGS[0], "")[:40]]
                alone = [parser.parse(text) for text in texts]
                together = interleaved_results(parser, texts, SplitCollector)
                for text, own, got in zip(texts, alone, together, strict=True):
                    assert got == own, (
                        f"streams of one parser interfere: streaming {text!r} in turn with {len(texts) - 1} other "
                        f"streams of the same parser (and parse() calls between its pieces) gave {got}; alone it "
                        f"parses as {own}. Keep per-output state in the stream object, made fresh by stream()"
                    )

    def test_stray_markup_never_raises(self, parsers: list[tuple[dict[str, Any], ReasoningParser]]) -> None:
        rng = random.Random(SEED)
        for options, parser in parsers:
            with with_options(options):
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
                    got = streamed(parser.stream(), [text[:cut], text[cut:]])
                    assert got == whole, f"streaming {text!r} gave {got}, parse gave {whole}"

    def _check_streams(self, parser: ReasoningParser, text: str, rng: random.Random, *, every_cut: bool = True) -> None:
        whole = parser.parse(text)
        for pieces in splits(text, rng, every_cut=every_cut):
            got = streamed(parser.stream(), pieces)
            assert got == whole, f"streaming {pieces!r} gave {got}, the whole text parses as {whole}"
