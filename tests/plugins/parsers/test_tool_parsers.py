"""The two parser kinds without a model: the conformance suites of the built-ins, and outputs real models wrote."""

from __future__ import annotations

import json

import pytest

from patchbay.contract.registry import default_registry
from patchbay.interfaces import ParsedToolCalls, ReasoningSplit, ToolCall
from patchbay.testing import ReasoningParserSuite, ToolParserSuite
from patchbay.testing.reasoning_parser import streamed as streamed_reasoning
from patchbay.testing.tool_parser import streamed as streamed_calls


class TestHermesConformance(ToolParserSuite):
    plugin_name = "hermes"


class TestLlama3JsonConformance(ToolParserSuite):
    plugin_name = "llama3_json"


class TestMistralConformance(ToolParserSuite):
    plugin_name = "mistral"


class TestThinkConformance(ReasoningParserSuite):
    plugin_name = "think"


def tool_parser(name: str):
    return default_registry().resolve("tool_parser", name)()


def call(name: str, **arguments) -> tuple[str, dict]:
    return name, arguments


def calls_of(parsed: ParsedToolCalls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


# Outputs in the shapes the models' own chat templates and model cards show (written here, not generated).
QWEN_OUTPUT = (
    'I will check both cities.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "c"}}\n'
    "</tool_call>"
)
LLAMA_OUTPUT = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "parameters": {"zone": "CET"}}'
)
MISTRAL_OUTPUT = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]'


@pytest.mark.parametrize(
    ("name", "text", "content", "expected"),
    [
        (
            "hermes",
            QWEN_OUTPUT,
            "I will check both cities.\n\n",
            [call("get_weather", city="Paris"), call("get_weather", city="Berlin", unit="c")],
        ),
        ("hermes", '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>', "", [call("f", x=1)]),
        ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": 1}}', "", [call("f", x=1)]),  # cut at the limit
        (
            "hermes",
            '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call> ok',
            '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call> ok',
            [],
        ),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
        (
            "hermes",
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
            [],
        ),
        ("llama3_json", LLAMA_OUTPUT, "", [call("get_weather", city="Paris"), call("get_time", zone="CET")]),
        ("llama3_json", '  {"name": "f", "parameters": {}}', "", [call("f")]),
        ("llama3_json", '{"name": "f", "parameters": {}} and more', '{"name": "f", "parameters": {}} and more', []),
        ("llama3_json", 'The answer: {"name": "f"}', 'The answer: {"name": "f"}', []),
        ("mistral", MISTRAL_OUTPUT, "", [call("get_weather", city="Paris", unit="celsius")]),
        (
            "mistral",
            'Let me see.[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"k": [1]}}]',
            "Let me see.",
            [call("a"), call("b", k=[1])],
        ),
        ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {}', '[TOOL_CALLS][{"name": "a", "arguments": {}', []),
    ],
)
def test_model_outputs_parse_whole_and_streamed(name, text, content, expected):
    parser = tool_parser(name)
    parsed = parser.parse(text)
    assert (parsed.content, calls_of(parsed)) == (content, expected)
    for size in (1, 3, 7):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        assert streamed_calls(parser.stream(), pieces) == parsed


def test_hermes_streams_content_before_the_call_is_complete():
    stream = tool_parser("hermes").stream()
    assert stream.feed("Checking <tool").content == "Checking "
    assert stream.feed('_call>\n{"name": "f", ').content == ""
    delta = stream.feed('"arguments": {"a": 1}}\n</tool_call> done')
    assert [(i.index, i.name, json.loads(i.arguments)) for i in delta.tool_calls] == [(0, "f", {"a": 1})]
    assert delta.content == " done"
    assert not stream.finish()


@pytest.mark.parametrize(
    ("text", "options", "expected"),
    [
        ("<think>\n2 + 2 = 4\n</think>\n\nIt is 4.", {}, ReasoningSplit("\n2 + 2 = 4\n", "It is 4.")),
        ("  <think>hm</think>4", {}, ReasoningSplit("hm", "4")),
        ("It is 4.", {}, ReasoningSplit(None, "It is 4.")),
        ("<think>never closed", {}, ReasoningSplit("never closed", "")),
        ("I think </think> so", {}, ReasoningSplit(None, "I think </think> so")),
        ("2 + 2 = 4\n</think>\n\nIt is 4.", {"starts_in_reasoning": True}, ReasoningSplit("2 + 2 = 4\n", "It is 4.")),
        ("<think>x</think>y", {"starts_in_reasoning": True}, ReasoningSplit("x", "y")),
    ],
)
def test_think_splits_reasoning_whole_and_streamed(text, options, expected):
    cls = default_registry().resolve("reasoning_parser", "think")
    parser = cls(cls.Options(**options))
    assert parser.parse(text) == expected
    for size in (1, 2, 5):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        assert streamed_reasoning(parser.stream(), pieces) == expected


def test_llama3_cannot_render_content_next_to_calls():
    with pytest.raises(ValueError, match="cannot hold content"):
        tool_parser("llama3_json").render("hi", [ToolCall("f", "{}")])
