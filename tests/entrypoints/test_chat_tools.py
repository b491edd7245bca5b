"""Chat with tools without a model: planning tool_choice, checking the conversation, the bundled tools template,
and reading answers whole and streamed alike."""

from __future__ import annotations

import json
import random

import pytest

from patchbay.contract.registry import default_registry
from patchbay.entrypoints.chat import (
    BUNDLED_TOOLS_TEMPLATE,
    AnswerReader,
    ChatAnswer,
    ChatRequestError,
    calls_schema,
    check_constraint_compiles,
    plan_tools,
    render_chat,
    template_messages,
)
from patchbay.interfaces import ToolCall
from patchbay.testing.structured_output import bundled_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def parser(kind: str, name: str):
    return default_registry().resolve(kind, name)()


# -- tool_choice ------------------------------------------------------------------------------------------


def test_tool_choice_modes_and_their_constraints():
    assert plan_tools(None).mode == "none"
    assert plan_tools([WEATHER]).mode == "auto"
    assert plan_tools([WEATHER], "none").constraint() is None
    named = plan_tools([WEATHER, ADD], {"type": "function", "function": {"name": "add"}})
    assert (named.mode, named.constraint()) == (
        "named",
        {"json_schema": ADD["function"]["parameters"], "json_whitespace": "compact"},
    )
    assert named.constraint(compact=False) == {"json_schema": ADD["function"]["parameters"]}
    required = plan_tools([WEATHER, ADD], "required", parallel_tool_calls=False)
    schema = required.constraint()["json_schema"]
    assert schema == calls_schema(required.functions, parallel=False) and schema["maxItems"] == 1
    assert [option["properties"]["name"] for option in schema["items"]["anyOf"]] == [
        {"enum": ["get_weather"]},
        {"enum": ["add"]},
    ]


def test_the_required_schema_accepts_exactly_calls_to_the_offered_tools():
    jsonschema = pytest.importorskip("jsonschema")
    schema = plan_tools([WEATHER, ADD], "required").constraint()["json_schema"]
    jsonschema.validate(
        [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}], schema
    )
    for bad in (
        [],
        [{"name": "add", "arguments": {"a": 1}}],
        [{"name": "sub", "arguments": {}}],
        [{"name": "add", "arguments": {"a": 1, "b": 2}, "extra": 1}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
        ([WEATHER], "sometimes", "tool_choice"),
        (None, "required", "tool_choice"),
        ([{"type": "retrieval"}], None, "tools.0.type"),
        ([{"type": "function", "function": {"description": "no name"}}], None, "tools.0.function.name"),
        ([WEATHER, WEATHER], None, "tools.1.function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, "tools.0.function.parameters"),
    ],
)
def test_bad_tool_fields_name_the_field(tools, choice, param):
    with pytest.raises(ChatRequestError) as raised:
        plan_tools(tools, choice)
    assert raised.value.param == param and str(raised.value).startswith(param)


def test_a_schema_the_backend_refuses_names_the_tool():
    broken = {"type": "function", "function": {"name": "broken", "parameters": {"type": "nonsense"}}}
    plan = plan_tools([WEATHER, broken], "required")

    def compile_schema(schema):
        if "nonsense" in json.dumps(schema):
            raise RuntimeError('Unsupported type "nonsense"')

    with pytest.raises(ChatRequestError) as raised:
        check_constraint_compiles(plan, compile_schema)
    assert raised.value.param == "tools.1.function.parameters" and "nonsense" in str(raised.value)
    check_constraint_compiles(plan_tools([WEATHER], "required"), compile_schema)


# -- the conversation -------------------------------------------------------------------------------------


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_tool_messages_must_answer_an_earlier_call():
    messages = template_messages(
        [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
    )
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    for bad, param in (
        ([{"role": "tool", "tool_call_id": "call_9", "content": "x"}], "messages.1.tool_call_id"),
        ([{"role": "tool", "content": "x"}], "messages.1.tool_call_id"),
    ):
        with pytest.raises(ChatRequestError) as raised:
            template_messages([{"role": "assistant", "content": "", "tool_calls": [CALL]}, *bad])
        assert raised.value.param == param
    with pytest.raises(ChatRequestError) as raised:
        template_messages(
            [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}],
                }
            ]
        )
    assert raised.value.param == "messages.0.tool_calls.0.function.arguments"


CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ],
    [{"role": "user", "content": "a"}, {"role": "system", "content": "late system"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_the_bundled_tools_template_renders_as_the_models_own_without_tools(messages):
    tokenizer = bundled_tokenizer()
    own = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ours, ids = render_chat(tokenizer, messages, tools=None, template=BUNDLED_TOOLS_TEMPLATE.read_text())
    assert ours == own and ids == tokenizer.encode(own, add_special_tokens=False)


def test_the_bundled_tools_template_renders_tools_calls_and_results_in_the_hermes_format():
    tokenizer = bundled_tokenizer()
    messages = template_messages(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
    )
    text, _ = render_chat(tokenizer, messages, tools=[WEATHER], template=BUNDLED_TOOLS_TEMPLATE.read_text())
    assert json.dumps(WEATHER["function"]) in text
    rendered_call = parser("tool_parser", "hermes").render("", [ToolCall("get_weather", '{"city": "Paris"}')])
    assert f"<|im_start|>assistant\n{rendered_call}<|im_end|>" in text
    assert "<tool_response>\nsunny\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    with pytest.raises(ChatRequestError) as raised:  # the model's own template has no tools section
        render_chat(tokenizer, messages, tools=[WEATHER], template=None)
    assert raised.value.param == "tools"


# -- reading answers --------------------------------------------------------------------------------------


ANSWERS = [
    "<think>Paris is in France.</think>\n\nLet me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n',
    '\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    "<think>no tools needed</think>It is 4.",
    'Plain answer with a broken <tool_call>{"name": </tool_call>',
]


def read_streamed(reader: AnswerReader, pieces: list[str]) -> ChatAnswer:
    stream = reader.stream()
    content, reasoning, names, arguments = [], [], {}, {}
    for delta in [*(stream.feed(piece) for piece in pieces), stream.finish()]:
        content.append(delta.content)
        reasoning.append(delta.reasoning)
        for piece in delta.tool_calls:
            shaped = piece.as_openai()
            if piece.index not in names:
                assert shaped["id"].startswith("call_") and shaped["type"] == "function"
                names[piece.index] = shaped["function"]["name"]
            arguments[piece.index] = arguments.get(piece.index, "") + shaped["function"]["arguments"]
    text = "".join(content)
    return ChatAnswer(
        text if text or not names else None,
        "".join(reasoning) or None,
        tuple((names[i], arguments[i]) for i in sorted(names)),
    )


@pytest.mark.parametrize("answer", ANSWERS)
def test_an_answer_reads_alike_whole_and_streamed(answer):
    reader = AnswerReader(
        plan_tools([WEATHER, ADD]), parser("tool_parser", "hermes"), parser("reasoning_parser", "think")
    )
    whole = reader.read(answer)
    expected = ChatAnswer(
        whole.content, whole.reasoning or None, tuple((call.name, call.arguments) for call in whole.tool_calls)
    )
    rng = random.Random(7)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(answer)), rng.randint(1, 10)))
        pieces = [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)], strict=True)]
        assert read_streamed(reader, pieces) == expected, pieces


def test_what_the_answers_hold():
    reader = AnswerReader(
        plan_tools([WEATHER, ADD]), parser("tool_parser", "hermes"), parser("reasoning_parser", "think")
    )
    first = reader.read(ANSWERS[0])
    assert (first.reasoning, first.content) == ("Paris is in France.", "Let me check.\n\n")
    assert [(c.name, json.loads(c.arguments)) for c in first.tool_calls] == [("get_weather", {"city": "Paris"})]
    second = reader.read(ANSWERS[1])
    assert second.content is None and [c.name for c in second.tool_calls] == ["add", "get_weather"]
    assert len({c.id for c in second.tool_calls}) == 2
    assert reader.read(ANSWERS[3]).tool_calls == () and reader.read(ANSWERS[3]).content == ANSWERS[3]
    no_tools = AnswerReader(plan_tools([WEATHER], "none"), parser("tool_parser", "hermes"), None)
    assert no_tools.read(ANSWERS[1]) == ChatAnswer(ANSWERS[1], None)


def test_enforced_answers_are_the_calls_json():
    required = AnswerReader(plan_tools([WEATHER, ADD], "required"), parser("tool_parser", "hermes"), None)
    answer = required.read('[{"name": "add", "arguments": {"a": 1, "b": 2}}]')
    assert answer.content is None and [(c.name, json.loads(c.arguments)) for c in answer.tool_calls] == [
        ("add", {"a": 1, "b": 2})
    ]
    named = AnswerReader(plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}), None, None)
    assert [c.name for c in named.read('{"city": "Oslo"}').tool_calls] == ["get_weather"]
    cut_short = named.read('{"city": "Os')
    assert cut_short.tool_calls == () and cut_short.content == ""  # the cut call is not passed off as content
    assert read_streamed(named, ['{"ci', 'ty": "Oslo"}']).tool_calls == (("get_weather", '{"city": "Oslo"}'),)


CUT_CALLS = [
    ('[{"name":"add","arguments":{"a":1,"b":2}},{"name":"get_weather","argum', [("add", {"a": 1, "b": 2})]),
    ('[{"name":"add","arguments":{"a":1,"b":2}}, ', [("add", {"a": 1, "b": 2})]),
    ('[{"name":"add","arguments":{"a":1,"b":2}}', [("add", {"a": 1, "b": 2})]),
    ('[{"name":"add","arguments":{"a":1', []),
    ("[", []),
    ("", []),
]


@pytest.mark.parametrize(("text", "calls"), CUT_CALLS)
def test_an_enforced_answer_cut_short_keeps_its_complete_calls_and_no_content(text, calls):
    plan = plan_tools([WEATHER, ADD], "required")
    found = plan.enforced_calls(text)
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == calls and not found.complete
    answer = AnswerReader(plan, None, None).read(text)
    assert [(c.name, json.loads(c.arguments)) for c in answer.tool_calls] == calls
    assert answer.content == (None if calls else "")
    streamed = read_streamed(AnswerReader(plan, None, None), [text[:7], text[7:]])
    assert [(name, json.loads(arguments)) for name, arguments in streamed.tool_calls] == calls
    assert not streamed.content


def test_whole_enforced_answers_are_complete_whatever_their_spacing():
    plan = plan_tools([WEATHER, ADD], "required")
    for text in (
        '[{"name":"add","arguments":{"a":1,"b":2}}]',
        '\n[ {"name": "add",\n "arguments": {"a": 1, "b": 2}} ]\n',
    ):
        found = plan.enforced_calls(text)
        assert found.complete and [c.name for c in found.calls] == ["add"]
    assert plan.enforced_calls("[]").complete


def test_a_streamed_enforced_call_is_sent_as_soon_as_its_json_closes():
    stream = AnswerReader(plan_tools([WEATHER, ADD], "required"), None, None).stream()
    assert not stream.feed('[{"name":"add","arguments":{"a":1,"b":2')
    first = stream.feed('}},{"name":"get_weather"')
    assert [(piece.name, piece.arguments) for piece in first.tool_calls] == [("add", '{"a": 1, "b": 2}')]
    second = stream.feed(',"arguments":{"city":"Oslo"}}]')
    assert [(piece.index, piece.name) for piece in second.tool_calls] == [(1, "get_weather")]
    assert not stream.finish()
