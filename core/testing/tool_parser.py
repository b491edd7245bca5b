"""Conformance suite for tool-call parsers: round trips, every split of a stream, malformed calls.

A parser author's test file::

    from patchbay.testing import ToolParserSuite

    class TestMyParser(ToolParserSuite):
        plugin_name = "my_format"

The suite writes calls and content in the parser's own format
(:meth:`ToolParser.render`) and checks, with no knowledge of the format:

- parsing a rendered text gives back its content and calls (arguments
  compared as decoded JSON); text with no calls is all content;
- streaming any text (rendered, cut short at every length, or malformed)
  cut into two pieces at every position, one character at a time and in
  random pieces adds up to the whole parse: the same content, the same calls
  in the same order, each named in its first piece only, arguments
  concatenating to the same text;
- a call whose JSON is broken (a brace dropped) is no call: the whole text
  comes back as content, and nothing raises;
- every call's arguments is the text of a JSON object.

Options for ``patchbay check`` come from ``PATCHBAY_TEST_TOOL_PARSER_OPTIONS`` (JSON).
"""

from __future__ import annotations

import json
import os
import random
from typing import Any, ClassVar

import pytest

from patchbay.interfaces import (
    Capabilities,
    ParsedToolCalls,
    ServingConfig,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    ToolParserCapabilities,
)
from patchbay.testing.suite import PluginSuite

OPTIONS_ENV = "PATCHBAY_TEST_TOOL_PARSER_OPTIONS"
SEED = 20241127

CONTENTS = (
    "",
    "Sure, let me look that up.",
    "Use <b>bold</b>, [brackets] and {braces}; ok?\n",
    "Caf\u00e9 \u2615 \u2014 \u00fcber \u4e2d\u6587",
)
"""Text a model might write next to calls: markup-like characters, but no format's marker."""
CALLS = (
    ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "celsius"})),
    ToolCall(
        "search",
        json.dumps(
            {
                "query": 'a "quoted"; {braced} [listed] <tagged> \\ text',
                "limit": 3,
                "exact": False,
                "filters": {"year": [2023, 2024], "lang": None},
            }
        ),
    ),
    ToolCall("now", "{}"),
    ToolCall(
        "translate", json.dumps({"text": "\u00e7a va \u2615 \u4f60\u597d\n\ttabbed", "to": "en"}, ensure_ascii=False)
    ),
)


def _decoded(calls: tuple[ToolCall, ...] | list[ToolCall]) -> list[tuple[str, Any]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def check_arguments(parsed: ParsedToolCalls, text: str) -> None:
    """Every call has a name and arguments that are the text of a JSON object."""
    for call in parsed.tool_calls:
        assert isinstance(call.name, str) and call.name, f"a call without a name parsing {text!r}"
        try:
            arguments = json.loads(call.arguments)
        except (TypeError, json.JSONDecodeError) as exc:
            pytest.fail(
                f"call {call.name!r} has arguments that are not JSON ({exc}): {call.arguments!r}, parsing {text!r}"
            )
        assert isinstance(arguments, dict), f"call {call.name!r} has arguments that are not an object: {arguments!r}"


def streamed(stream: ToolCallStream, pieces: list[str]) -> ParsedToolCalls:
    """What a client puts together from the deltas of ``pieces`` (checking the deltas' shape on the way)."""
    content: list[str] = []
    names: list[str] = []
    arguments: list[list[str]] = []

    def take(delta: ToolCallDelta) -> None:
        assert isinstance(delta, ToolCallDelta), f"a stream returned {type(delta).__name__}, not a ToolCallDelta"
        content.append(delta.content)
        for item in delta.tool_calls:
            if item.index == len(names):
                assert item.name, f"the first piece of call {item.index} must carry its name"
                names.append(item.name)
                arguments.append([])
            else:
                assert item.index < len(names), f"call {item.index} streamed before call {len(names)}"
                assert item.name is None, f"call {item.index} was named again in a later piece"
            arguments[item.index].append(item.arguments)

    for piece in pieces:
        take(stream.feed(piece))
    take(stream.finish())
    return ParsedToolCalls(
        "".join(content), tuple(ToolCall(name, "".join(parts)) for name, parts in zip(names, arguments, strict=True))
    )


def splits(text: str, rng: random.Random) -> list[list[str]]:
    """Every cut into two pieces, one character at a time, and a few random cuttings."""
    found = [[text[:cut], text[cut:]] for cut in range(len(text) + 1)]
    found.append(list(text))
    for _ in range(4):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        found.append([text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])
    return found


class ToolParserBaseSuite(PluginSuite):
    kind: ClassVar[str] = "tool_parser"
    capabilities_class: ClassVar[type[Capabilities]] = ToolParserCapabilities

    def unsupported_configs(self, capabilities: Capabilities) -> list[tuple[str, ServingConfig]]:
        return []  # parsers read text on the host: every device and dtype is served


class ToolParserSuite(ToolParserBaseSuite):
    """The conformance suite of the ``tool_parser`` kind."""

    @pytest.fixture
    def parser(self, available: type[ToolParser]) -> ToolParser:
        """The parser under test, with options from ``PATCHBAY_TEST_TOOL_PARSER_OPTIONS`` (JSON) if set."""
        options = json.loads(os.environ.get(OPTIONS_ENV) or "{}")
        return available(available.Options.model_validate(options))

    def cases(self, parser: ToolParser) -> list[tuple[str, tuple[ToolCall, ...]]]:
        """(content, calls) pairs the format can hold."""
        capabilities = parser.capabilities
        call_lists: list[tuple[ToolCall, ...]] = [(call,) for call in CALLS]
        if capabilities.parallel_calls:
            call_lists += [CALLS[:2], CALLS]
        found: list[tuple[str, tuple[ToolCall, ...]]] = [(content, ()) for content in CONTENTS]
        for calls in call_lists:
            for content in CONTENTS if capabilities.content_with_calls else ("",):
                found.append((content, calls))
        return found

    def test_rendered_calls_parse_back(self, parser: ToolParser) -> None:
        for content, calls in self.cases(parser):
            text = parser.render(content, calls)
            parsed = parser.parse(text)
            check_arguments(parsed, text)
            assert parsed.content == content, f"content of {text!r}: got {parsed.content!r}, wrote {content!r}"
            assert _decoded(parsed.tool_calls) == _decoded(calls), f"calls of {text!r}: got {parsed.tool_calls}"

    def test_text_without_calls_is_content(self, parser: ToolParser) -> None:
        for content in CONTENTS:
            assert parser.parse(content) == ParsedToolCalls(content), f"{content!r} is not all content"

    def test_every_split_of_a_stream_adds_up_to_the_whole(self, parser: ToolParser) -> None:
        rng = random.Random(SEED)
        for content, calls in self.cases(parser):
            text = parser.render(content, calls)
            self._check_streams(parser, text, rng)

    def test_outputs_cut_short_parse_alike_whole_and_streamed(self, parser: ToolParser) -> None:
        rng = random.Random(SEED)
        for content, calls in self.cases(parser):
            if not calls:
                continue
            text = parser.render(content, calls)
            for length in range(len(text)):
                prefix = text[:length]
                whole = parser.parse(prefix)
                check_arguments(whole, prefix)
                cut = rng.randint(0, length)
                for pieces in ([prefix], [prefix[:cut], prefix[cut:]]):
                    assert streamed(parser.stream(), pieces) == whole, f"stream of {pieces!r} != parse"

    def test_malformed_calls_come_back_as_content(self, parser: ToolParser) -> None:
        rng = random.Random(SEED)
        for content, calls in self.cases(parser):
            if len(calls) != 1 or content:
                continue  # the braces to break must be the call's, not the content's
            text = parser.render(content, calls)
            for broken in (_drop(text, text.rfind("}")), _drop(text, text.find("{"))):
                parsed = parser.parse(broken)
                assert parsed == ParsedToolCalls(broken), (
                    f"a malformed call must come back as content: {broken!r} parsed as {parsed}"
                )
                self._check_streams(parser, broken, rng, every_cut=False)

    def test_parse_never_raises_on_noise(self, parser: ToolParser) -> None:
        rng = random.Random(SEED)
        texts = [parser.render(content, calls) for content, calls in self.cases(parser)]
        for _ in range(300):
            fragments = []
            for _ in range(rng.randint(0, 5)):
                source = rng.choice(texts)
                start = rng.randint(0, len(source))
                fragments.append(source[start : start + rng.randint(0, 40)])
            text = "".join(fragments)
            parsed = parser.parse(text)
            check_arguments(parsed, text)
            cut = rng.randint(0, len(text))
            assert streamed(parser.stream(), [text[:cut], text[cut:]]) == parsed, f"stream of {text!r} != parse"

    def _check_streams(self, parser: ToolParser, text: str, rng: random.Random, *, every_cut: bool = True) -> None:
        whole = parser.parse(text)
        check_arguments(whole, text)
        cuttings = splits(text, rng) if every_cut else splits(text, rng)[-5:]
        for pieces in cuttings:
            got = streamed(parser.stream(), pieces)
            assert got == whole, f"streaming {pieces!r} gave {got}, the whole text parses as {whole}"

    def test_render_without_calls_is_the_content(self, parser: ToolParser) -> None:
        for content in CONTENTS:
            assert parser.render(content, []) == content


def _drop(text: str, index: int) -> str:
    return text if index < 0 else text[:index] + text[index + 1 :]
