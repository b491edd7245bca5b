"""Conformance suite for tool-call parsers: what the parser writes, what models write, streams, one parser shared.

A parser author's test file::

    from patchbay.testing import ToolParserSuite

    class TestMyParser(ToolParserSuite):
        plugin_name = "my_format"

The suite knows no format.  It writes calls and content in the parser's own
format (:meth:`ToolParser.render`), then the same calls as models write them
(:mod:`patchbay.testing.call_spellings`, by the declared
``arguments_syntax``), and checks:

- parsing gives back the content and the calls, arguments compared as
  decoded JSON: rendered calls, calls whose strings hold ``}``, ``]``, ``,``,
  ``)``, quotes, backslashes and unicode, every Python literal kind, and
  re-spelled calls (escapes, spacing, key order, arguments as the text of a
  JSON object, quotes); text with no calls is all content;
- text written after the calls, or between two calls, is never lost and
  no call is invented; a text cut short at any length gives no call it
  does not hold in full, and all its text as content when it gives none;
- streaming any of these texts cut at every position, one character at a
  time and in random pieces adds up to the whole parse: the same content,
  the same calls in the same order, each named in its first piece only;
- streams of one parser fed in turn, with ``parse`` and new streams in
  between, each give what they give alone;
- a call broken (a brace or a parenthesis dropped) is no call: the whole
  text comes back as content, and nothing raises.

Every check runs once per combination of the parser's finite-valued options
(booleans, ``Literal`` and ``Enum`` fields); options given in
``PATCHBAY_TEST_TOOL_PARSER_OPTIONS`` (JSON) or by ``patchbay check --options``
are fixed for all of them.
"""

from __future__ import annotations

import json
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
from patchbay.testing.call_spellings import JSON_SPELLINGS, PYTHON_SPELLINGS, CallsNotFound, respell
from patchbay.testing.parser_checks import build_parsers, interleaved_results, splits, with_options
from patchbay.testing.suite import PluginSuite, options_env, skip_not_declared

OPTIONS_ENV = options_env("tool_parser")
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
MODEL_CALLS = (
    ToolCall("add_note", json.dumps({"note": "a, b (c)", "title": "x) y, z(", "tags": ["p, q", "r)"]})),
    ToolCall("find_pattern", json.dumps({"pattern": "^} *$", "closing": "]}", "quoted_json": '{"a": [1, 2]}'})),
    ToolCall(
        "say",
        json.dumps(
            {
                "text": 'she said "hi" \\ back, it\'s late',
                "path": "C:\\temp\\new",
                "url": "https://example.com/a/b?c=d&e=f",
            }
        ),
    ),
    ToolCall(
        "translate",
        json.dumps(
            {"text": "S\u00e3o Paulo \u2615 \u4e2d\u6587 \U0001f389", "lines": "one\ntwo\tthree\r\n", "mark": "\u2028"},
            ensure_ascii=False,
        ),
    ),
    ToolCall(
        "configure",
        json.dumps(
            {
                "count": -3,
                "ratio": 0.0025,
                "scale": 1e21,
                "big": 12345678901234567890,
                "enabled": True,
                "verbose": False,
                "limit": None,
            }
        ),
    ),
    ToolCall(
        "nested",
        json.dumps(
            {
                "filters": {"years": [2023, 2024], "tags": [], "meta": {}},
                "matrix": [[1, -2.5], []],
                "deep": [{"k": [None, True]}],
            }
        ),
    ),
    ToolCall("now", "{}"),
)
"""Calls whose arguments trip what is not a real parser: ``}``, ``]``, ``,`` and ``)`` inside strings, escaped
quotes and backslashes, unicode beyond the BMP, JSON text inside a string, every JSON (and Python literal) kind."""
AFTER = "\nThat should do it (tell me if not)."
BETWEEN = "\nAnd now the other one:\n"
"""Plain text a model writes after its calls, or between two of them."""


def _decoded(calls: tuple[ToolCall, ...] | list[ToolCall]) -> list[tuple[str, Any]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def check_arguments(parsed: ParsedToolCalls, text: str) -> None:
    """Every call has a name and arguments that are the text of a JSON object; the content is a string."""
    assert isinstance(parsed.content, str), f"content must be a string ('' for none), got {parsed.content!r}"
    for call in parsed.tool_calls:
        assert isinstance(call.name, str) and call.name, f"a call without a name parsing {text!r}"
        try:
            arguments = json.loads(call.arguments)
        except (TypeError, json.JSONDecodeError) as exc:
            pytest.fail(
                f"call {call.name!r} has arguments that are not JSON ({exc}): {call.arguments!r}, parsing {text!r}"
            )
        assert isinstance(arguments, dict), (
            f"call {call.name!r} has arguments that are not a JSON object: {arguments!r}, parsing {text!r} "
            "(arguments a model wrote as the text of a JSON object are that object)"
        )


class DeltaCollector:
    """What a client puts together from one stream's deltas, checking their shape on the way."""

    def __init__(self, stream: ToolCallStream) -> None:
        self.stream = stream
        self.content: list[str] = []
        self.names: list[str] = []
        self.arguments: list[list[str]] = []

    def take(self, delta: ToolCallDelta) -> None:
        """Add one delta."""
        assert isinstance(delta, ToolCallDelta), f"a stream returned {type(delta).__name__}, not a ToolCallDelta"
        self.content.append(delta.content)
        for item in delta.tool_calls:
            if item.index == len(self.names):
                assert item.name, f"the first piece of call {item.index} must carry its name"
                self.names.append(item.name)
                self.arguments.append([])
            else:
                assert item.index < len(self.names), f"call {item.index} streamed before call {len(self.names)}"
                assert item.name is None, f"call {item.index} was named again in a later piece"
            self.arguments[item.index].append(item.arguments)

    def feed(self, piece: str) -> None:
        """Feed ``piece`` to the stream and take its delta."""
        self.take(self.stream.feed(piece))

    def finish(self) -> ParsedToolCalls:
        """Finish the stream: the content and calls the deltas add up to."""
        self.take(self.stream.finish())
        calls = (ToolCall(name, "".join(parts)) for name, parts in zip(self.names, self.arguments, strict=True))
        return ParsedToolCalls("".join(self.content), tuple(calls))


def streamed(stream: ToolCallStream, pieces: list[str]) -> ParsedToolCalls:
    """What a client puts together from the deltas of ``pieces`` (checking the deltas' shape on the way)."""
    collector = DeltaCollector(stream)
    for piece in pieces:
        collector.feed(piece)
    return collector.finish()


def _is_subsequence(found: list[tuple[str, Any]], written: list[tuple[str, Any]]) -> bool:
    remaining = iter(written)
    return all(any(call == candidate for candidate in remaining) for call in found)


class ToolParserBaseSuite(PluginSuite):
    kind: ClassVar[str] = "tool_parser"
    capabilities_class: ClassVar[type[Capabilities]] = ToolParserCapabilities

    def unsupported_configs(self, capabilities: Capabilities) -> list[tuple[str, ServingConfig]]:
        return []  # parsers read text on the host: every device and dtype is served


class ToolParserSuite(ToolParserBaseSuite):
    """The conformance suite of the ``tool_parser`` kind."""

    @pytest.fixture
    def parsers(self, available: type[ToolParser]) -> list[tuple[dict[str, Any], ToolParser]]:
        """The parser under test, once per combination of its finite-valued options (``{}``: the defaults)."""
        return build_parsers(available, self.given_options())

    # -- what the texts are ---------------------------------------------------------------------------

    def cases(self, parser: ToolParser) -> list[tuple[str, tuple[ToolCall, ...]]]:
        """(content, calls) pairs of :data:`CALLS` the format can hold."""
        return self._cases(parser, CALLS, CONTENTS)

    def model_cases(self, parser: ToolParser) -> list[tuple[str, tuple[ToolCall, ...]]]:
        """(content, calls) pairs of :data:`MODEL_CALLS`: each alone and, if the format allows, all together."""
        return self._cases(parser, MODEL_CALLS, CONTENTS[:2], all_together=True)

    def _cases(
        self,
        parser: ToolParser,
        calls: tuple[ToolCall, ...],
        contents: tuple[str, ...],
        *,
        all_together: bool = False,
    ) -> list[tuple[str, tuple[ToolCall, ...]]]:
        capabilities = parser.capabilities
        call_lists: list[tuple[ToolCall, ...]] = [(call,) for call in calls]
        if capabilities.parallel_calls:
            call_lists += [calls] if all_together else [calls[:2], calls]
        found: list[tuple[str, tuple[ToolCall, ...]]] = [] if all_together else [(text, ()) for text in contents]
        for call_list in call_lists:
            for content in contents if capabilities.content_with_calls else ("",):
                found.append((content, call_list))
        return found

    def spellings(self, parser: ToolParser) -> tuple[str, ...]:
        """The ways models spell calls in this parser's declared ``arguments_syntax``."""
        syntax = parser.capabilities.arguments_syntax
        return {"json": JSON_SPELLINGS, "python": PYTHON_SPELLINGS}.get(syntax, ())

    # -- checks ---------------------------------------------------------------------------------------

    def test_rendered_calls_parse_back(self, parsers: list[tuple[dict[str, Any], ToolParser]]) -> None:
        for options, parser in parsers:
            with with_options(options):
                for content, calls in self.cases(parser):
                    self._check_parse(parser, parser.render(content, calls), content, calls, "rendered")

    def test_text_without_calls_is_content(self, parsers: list[tuple[dict[str, Any], ToolParser]]) -> None:
        for options, parser in parsers:
            with with_options(options):
                for content in CONTENTS:
                    assert parser.parse(content) == ParsedToolCalls(content), f"{content!r} is not all content"

    def test_model_written_calls_parse_to_what_they_say(self, parsers: list[tuple[dict[str, Any], ToolParser]]) -> None:
        """Calls with tricky arguments, as rendered and in every spelling of the syntax, whole and streamed."""
        rng = random.Random(SEED)
        for options, parser in parsers:
            with with_options(options):
                syntax = parser.capabilities.arguments_syntax
                for content, calls in self.model_cases(parser):
                    rendered = parser.render(content, calls)
                    self._check_parse(parser, rendered, content, calls, "rendered")
                    self._check_streams(parser, rendered, rng, every_cut=len(calls) == 1)
                    for spelling in self.spellings(parser):
                        try:
                            text = respell(rendered, calls, syntax, spelling)
                        except CallsNotFound as exc:
                            pytest.fail(
                                f"{type(parser).__name__} declares arguments_syntax {syntax!r}, but in what its "
                                f"render wrote {exc} (declare the syntax it writes, or 'other')"
                            )
                        if text is None:
                            continue
                        self._check_parse(parser, text, content, calls, f"spelled {spelling}")
                        self._check_streams(parser, text, rng, every_cut=False)

    def test_text_after_and_between_calls_is_never_lost(self, parsers: list[tuple[dict[str, Any], ToolParser]]) -> None:
        """Whether the format keeps such calls or reads the whole text as content, the text is kept, no call is
        invented, and streams agree with the whole parse at every cut."""
        rng = random.Random(SEED)
        for options, parser in parsers:
            with with_options(options):
                texts: list[tuple[str, tuple[ToolCall, ...], str]] = []
                for content, calls in self.model_cases(parser)[:3] + [("", CALLS[:1])]:
                    texts.append((parser.render(content, calls) + AFTER, calls, AFTER))
                if parser.capabilities.parallel_calls:
                    first, second = MODEL_CALLS[0], MODEL_CALLS[2]
                    between = parser.render("", [first]) + BETWEEN + parser.render("", [second])
                    texts.append((between, (first, second), BETWEEN))
                    texts.append((between + AFTER, (first, second), AFTER))
                for text, calls, plain in texts:
                    parsed = parser.parse(text)
                    check_arguments(parsed, text)
                    found, written = _decoded(parsed.tool_calls), _decoded(calls)
                    assert _is_subsequence(found, written), (
                        f"parsing {text!r} gave calls {found} that it does not hold (it holds {written})"
                    )
                    if not found:
                        assert parsed.content == text, (
                            f"{text!r} parsed with no call must be all content, got content {parsed.content!r}"
                        )
                    assert plain.strip() in parsed.content, (
                        f"the text {plain.strip()!r} written next to the calls was lost: {text!r} parsed as "
                        f"content {parsed.content!r} and calls {found}"
                    )
                    self._check_streams(parser, text, rng)

    def test_every_split_of_a_stream_adds_up_to_the_whole(
        self, parsers: list[tuple[dict[str, Any], ToolParser]]
    ) -> None:
        rng = random.Random(SEED)
        for options, parser in parsers:
            with with_options(options):
                for content, calls in self.cases(parser):
                    self._check_streams(parser, parser.render(content, calls), rng)

    def test_outputs_cut_short_parse_alike_whole_and_streamed(
        self, parsers: list[tuple[dict[str, Any], ToolParser]]
    ) -> None:
        """An output stopped at any length (``max_tokens``) gives only calls it holds in full, in order, and all
        its text as content when it gives none; streamed as whole."""
        rng = random.Random(SEED)
        for options, parser in parsers:
            with with_options(options):
                cases = [case for case in self.cases(parser) if case[1]] + self.model_cases(parser)[-1:]
                for content, calls in cases:
                    text = parser.render(content, calls)
                    written = _decoded(calls)
                    for length in range(len(text)):
                        prefix = text[:length]
                        whole = parser.parse(prefix)
                        check_arguments(whole, prefix)
                        found = _decoded(whole.tool_calls)
                        assert found == written[: len(found)], (
                            f"the output cut short to {prefix!r} gave calls {found}; it holds in full at most "
                            f"the first ones of {written}"
                        )
                        if not found:
                            assert whole.content == prefix, (
                                f"the output cut short to {prefix!r} gave no call, so all of it is content; got "
                                f"{whole.content!r}"
                            )
                        cut = rng.randint(0, length)
                        for pieces in ([prefix], [prefix[:cut], prefix[cut:]]):
                            got = streamed(parser.stream(), pieces)
                            assert got == whole, f"streaming {pieces!r} gave {got}, the whole text parses as {whole}"

    def test_streams_of_one_parser_do_not_share_state(self, parsers: list[tuple[dict[str, Any], ToolParser]]) -> None:
        """One parser serves every request of a server: streams fed in turn, with ``parse`` of other texts and
        new streams in between, each give what they give alone."""
        for options, parser in parsers:
            with with_options(options):
                texts = [parser.render(content, calls) for content, calls in self.model_cases(parser)[:3]]
                texts += [CONTENTS[2], parser.render("", CALLS[:1])]
                alone = [parser.parse(text) for text in texts]
                together = interleaved_results(parser, texts, DeltaCollector)
                for text, own, got in zip(texts, alone, together, strict=True):
                    assert got == own, (
                        f"streams of one parser interfere: streaming {text!r} in turn with {len(texts) - 1} other "
                        f"streams of the same parser (and parse() calls between its pieces) gave {got}; alone it "
                        f"parses as {own}. Keep per-output state in the stream object, made fresh by stream()"
                    )

    def test_malformed_calls_come_back_as_content(self, parsers: list[tuple[dict[str, Any], ToolParser]]) -> None:
        rng = random.Random(SEED)
        for options, parser in parsers:
            with with_options(options):
                syntax = parser.capabilities.arguments_syntax
                if syntax not in ("json", "python"):
                    skip_not_declared(f"arguments_syntax {syntax!r}: the kit knows no way to break such a call")
                opener, closer = ("{", "}") if syntax == "json" else ("(", ")")
                for content, calls in self.cases(parser):
                    if len(calls) != 1 or content:
                        continue  # the brackets to break must be the call's, not the content's
                    text = parser.render(content, calls)
                    for broken in (_drop(text, text.rfind(closer)), _drop(text, text.find(opener))):
                        parsed = parser.parse(broken)
                        assert parsed == ParsedToolCalls(broken), (
                            f"a malformed call must come back as content: {broken!r} parsed as {parsed}"
                        )
                        self._check_streams(parser, broken, rng, every_cut=False)

    def test_parse_never_raises_on_noise(self, parsers: list[tuple[dict[str, Any], ToolParser]]) -> None:
        rng = random.Random(SEED)
        for options, parser in parsers:
            with with_options(options):
                texts = [parser.render(content, calls) for content, calls in self.cases(parser)]
                texts += [parser.render(content, calls) for content, calls in self.model_cases(parser)]
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

    def test_render_without_calls_is_the_content(self, parsers: list[tuple[dict[str, Any], ToolParser]]) -> None:
        for options, parser in parsers:
            with with_options(options):
                for content in CONTENTS:
                    assert parser.render(content, []) == content

    # -- helpers --------------------------------------------------------------------------------------

    def _check_parse(self, parser: ToolParser, text: str, content: str, calls: tuple[ToolCall, ...], how: str) -> None:
        parsed = parser.parse(text)
        check_arguments(parsed, text)
        found, written = _decoded(parsed.tool_calls), _decoded(calls)
        lost = " (calls lost)" if len(found) < len(written) else ""
        assert found == written, f"the calls of {text!r} ({how}) came back as {found}; the text holds {written}{lost}"
        assert parsed.content == content, f"content of {text!r} ({how}): got {parsed.content!r}, wrote {content!r}"

    def _check_streams(self, parser: ToolParser, text: str, rng: random.Random, *, every_cut: bool = True) -> None:
        whole = parser.parse(text)
        check_arguments(whole, text)
        for pieces in splits(text, rng, every_cut=every_cut):
            got = streamed(parser.stream(), pieces)
            assert got == whole, (
                f"streaming {pieces!r} gave {got}, the whole text parses as {whole}{_stream_hint(got, whole)}"
            )


def _stream_hint(got: ParsedToolCalls, whole: ParsedToolCalls) -> str:
    """What a stream that disagrees with the whole parse most likely did."""
    if len(got.tool_calls) > len(whole.tool_calls):
        return (
            ": the stream told calls the whole text does not hold (a call may be told only once no later text can "
            "make it content)"
        )
    if len(got.tool_calls) < len(whole.tool_calls):
        return ": the stream lost calls the whole text holds"
    return ""


def _drop(text: str, index: int) -> str:
    return text if index < 0 else text[:index] + text[index + 1 :]
